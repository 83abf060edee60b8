"""Fixtures for engine tests: tiny random DeepSeek-V3 checkpoints written once per session."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.engine.tiny_models import make_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """tiny_checkpoint(variant, seed=0) -> directory of a transformers-written float32 checkpoint (cached)."""
    root = tmp_path_factory.mktemp("tiny_checkpoints")

    def get(variant: str, seed: int = 0) -> Path:
        return make_tiny_checkpoint(root, variant, seed)

    return get
