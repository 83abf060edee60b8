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


def test_an_engine_built_on_the_caller_serves_on_the_engine_thread() -> None:
    """start(build_here=True) runs the factory on the calling thread (no engine thread yet: what lets a
    process with one thread fork its TP followers), then work and calls run on the engine thread; a
    failing factory raises from start() and no thread is left running."""

    built_on, worked_on = [], []

    class Engine:
        def close(self) -> None:
            pass

    def factory() -> Engine:
        built_on.append(threading.current_thread())
        return Engine()

    worked = threading.Event()

    def work(engine: Engine) -> bool:
        worked_on.append(threading.current_thread())
        worked.set()
        return False

    def named(name: str) -> list[threading.Thread]:  # (the process's other threads may come and go meanwhile)
        return [t for t in threading.enumerate() if t.name == name]

    thread = EngineThread(factory, work, name="built-here")
    engine = thread.start(build_here=True)
    try:
        assert isinstance(engine, Engine) and built_on == [threading.current_thread()]
        assert len(named("built-here")) == 1
        called_on = asyncio.run(thread.call(lambda _: threading.current_thread().name))
        thread.wake()
        assert worked.wait(60), "work() never ran"
    finally:
        thread.stop()
    assert called_on == "built-here" and all(t.name == "built-here" for t in worked_on)

    def broken() -> Engine:
        raise ValueError("no weights")

    failing = EngineThread(broken, work, name="never-built")
    with pytest.raises(RuntimeError, match="no weights"):
        failing.start(build_here=True)
    assert named("never-built") == [] and named("built-here") == []
