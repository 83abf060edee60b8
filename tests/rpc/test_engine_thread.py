"""EngineThread: every call runs on the one engine thread, results and errors reach the awaiting coroutine,
work() runs between commands, and stop() closes the engine."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from rpc.engine_thread import EngineThread


class _FakeEngine:
    def __init__(self) -> None:
        self.thread = threading.get_ident()
        self.calls: list[int] = []
        self.pending = 0
        self.steps = 0
        self.closed = False

    def close(self) -> None:
        self.closed = threading.get_ident() == self.thread


def _work(engine: _FakeEngine) -> bool:
    if engine.pending:
        engine.pending -= 1
        engine.steps += 1
        return True
    return False


async def test_calls_run_on_the_engine_thread_in_order():
    """Results come back in submission order, every call on the thread that built the engine."""
    runner = EngineThread(_FakeEngine, _work)
    engine = runner.start(timeout=60)
    results = [await runner.call(lambda e, i=i: (e.calls.append(i), threading.get_ident())[1]) for i in range(5)]
    assert engine.calls == list(range(5)) and set(results) == {engine.thread} != {threading.get_ident()}
    runner.stop()
    assert engine.closed


async def test_errors_propagate_and_work_runs_until_idle():
    """An exception raised by a call is re-raised to its caller; queued work is done before sleeping."""
    runner = EngineThread(_FakeEngine, _work)
    engine = runner.start(timeout=60)
    with pytest.raises(ZeroDivisionError):
        await runner.call(lambda e: 1 / 0)
    await runner.call(lambda e: setattr(e, "pending", 3))
    deadline = time.monotonic() + 60
    while engine.pending:  # no command arrives meanwhile: only work() can make progress
        assert time.monotonic() < deadline, "work() did not drain the pending steps"
        await asyncio.sleep(0.01)
    assert await runner.call(lambda e: (e.steps, e.pending)) == (3, 0)
    runner.stop()


def test_start_reports_construction_errors():
    """A factory that raises makes start() raise with the cause."""
    def broken() -> _FakeEngine:
        raise ValueError("no model")

    with pytest.raises(RuntimeError, match="no model"):
        EngineThread(broken, _work).start(timeout=60)
