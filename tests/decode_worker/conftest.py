"""Fixtures for decode worker tests: the service test model (a tiny random DeepSeek-V3 checkpoint + draft)."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.services.service_model import make_service_model


@pytest.fixture(scope="session")
def service_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_service_model(tmp_path_factory.mktemp("service_model"))
