"""Fixtures for decode worker tests: the service test model (a tiny random DeepSeek-V3 checkpoint + draft), and a
DecodeStream test server (tests/decode_worker/stream_server.py)."""
from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.decode_worker.stream_server import StreamWorker, serving
from tests.services.service_model import make_service_model


@pytest.fixture(scope="session")
def service_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_service_model(tmp_path_factory.mktemp("service_model"))


@pytest.fixture
async def stream_worker() -> AsyncIterator[StreamWorker]:
    async with serving() as worker:
        yield worker
