"""Suite-wide settings. TRITON_INTERPRET must be set before triton is first imported (Triton 3.9 reads
it when kernels are decorated), so the interpreter runs the Triton kernels on this CPU-only machine."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items) -> None:
    """Tests marked `compose` (a real container bring-up, ~15 min: scripts/compose.sh test, .ci/run) run only
    when the -m expression names them; the default run and `-m slow` leave them out. Tests marked `gpu` need a
    CUDA / ROCm device: skipped (not passed) on machines without one."""
    import pytest
    import torch

    if "compose" not in (config.option.markexpr or ""):
        deselected = [item for item in items if item.get_closest_marker("compose") is not None]
        if deselected:
            config.hook.pytest_deselected(items=deselected)
            items[:] = [item for item in items if item.get_closest_marker("compose") is None]
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a GPU (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
