"""Fixtures' work done once per test run instead of once per pytest-xdist worker."""
from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def run_wide(tmp_path_factory: pytest.TempPathFactory, name: str) -> Iterator[Path]:
    """A directory every pytest-xdist worker of this run shares (the workers' base temp directories have one
    parent), held under an exclusive lock: the first worker to need it builds what goes in, the others wait
    and reuse it instead of building their own (a service model, reference outputs, the tokenized corpus:
    each ~7-15 CPU seconds)."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / name
    root.mkdir(exist_ok=True)
    with open(f"{root}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield root
