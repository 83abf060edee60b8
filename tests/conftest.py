"""Suite-wide settings. TRITON_INTERPRET must be set before triton is first imported (Triton 3.9 reads
it when kernels are decorated), so the interpreter runs the Triton kernels on this CPU-only machine."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")

# Fixtures that start a deployment of worker processes: every test using one is `slow` (not in the fast loop).
PROCESS_CLUSTER_FIXTURES = frozenset({"cluster", "tp2_cluster", "mixed_tp_cluster", "live_gateway"})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks tests that start process clusters `slow`, so `pytest -m "not slow"` stays the fast loop."""
    for item in items:
        if PROCESS_CLUSTER_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
