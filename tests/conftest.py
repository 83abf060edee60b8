"""Suite-wide settings. TRITON_INTERPRET must be set before triton is first imported (Triton 3.9 reads
it when kernels are decorated), so the interpreter runs the Triton kernels on this CPU-only machine."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")
# One intra-op thread (before torch is first imported; subprocesses inherit it): the suite's tensors are tiny, and
# on a loaded 2-core machine two OpenMP threads spin at every barrier waiting for each other to be scheduled
# (measured: 17x the CPU seconds and 10x the wall time of one thread on the engine-vs-transformers tests).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The same for the tokenizers library's Rust thread pool (encoding the training corpus: 12.8 CPU s on one
# thread vs 16.6 on two, beside the other xdist worker).
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

pytest_plugins = ["tests.xdist_order", "tests.cpu_durations"]  # (cpu_durations imports xdist_order)

# Fixtures that start a deployment of worker processes: every test using one is `slow` (not in the fast loop).
PROCESS_CLUSTER_FIXTURES = frozenset({"cluster", "mixed_tp_cluster", "live_gateway"})


@pytest.fixture(autouse=True)
def _one_intra_op_thread():
    """Puts torch back to one intra-op thread after a test that raised it (torch.set_num_threads, or an
    in-process engine built with num_threads > 1): otherwise every later test in this xdist worker runs with
    OpenMP threads that spin at each barrier beside the other worker (measured: one test module left at 2
    threads cost its worker ~25 CPU s of spinning in the next test alone)."""
    yield
    import torch

    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items) -> None:
    """Tests marked `compose` (a real container bring-up, ~15 min: scripts/compose.sh test, .ci/run) run only
    when the -m expression names them; the default run and `-m slow` leave them out. Tests that start process
    clusters are marked `slow`, so `pytest -m "not slow"` stays the fast loop. Tests marked `gpu` need a
    CUDA / ROCm device: skipped (not passed) on machines without one."""
    import torch

    for item in items:
        if PROCESS_CLUSTER_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
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
