"""Suite-wide settings. TRITON_INTERPRET must be set before triton is first imported (Triton 3.9 reads
it when kernels are decorated), so the interpreter runs the Triton kernels on this CPU-only machine."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` need a CUDA / ROCm device: skipped (not passed) on machines without one."""
    import pytest
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a GPU (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
