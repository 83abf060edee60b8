"""Runs an LLMEngine (not thread-safe) on one dedicated thread and lets asyncio code call into it.

Every engine call happens on that thread: asyncio code submits a function with `call(fn)` and awaits
its result; between commands the thread runs `work()` (an engine step, a prefill batch) while it reports
that there is more to do, and otherwise sleeps until the next command. Results go back to the event
loop with loop.call_soon_threadsafe."""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from typing import Generic, TypeVar, Union

logger = logging.getLogger(__name__)

E = TypeVar("E")
T = TypeVar("T")
_STOP = object()
# A queued command: fn(engine), and where its result goes (None, None: nowhere).
Command = tuple[Callable[[E], object], Union[asyncio.AbstractEventLoop, None], Union["asyncio.Future[object]", None]]


class EngineThread(Generic[E]):
    """engine_factory runs on the thread (TP followers are spawned from there); work(engine) -> bool:
    True when it did something and should be called again before sleeping."""

    def __init__(self, engine_factory: Callable[[], E], work: Callable[[E], bool], name: str = "engine") -> None:
        self._factory = engine_factory
        self._work = work
        self._commands: queue.SimpleQueue[Command[E] | object] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.engine: E | None = None

    def start(self, timeout: float | None = None, build_here: bool = False) -> E:
        """Starts the thread and blocks until the engine is built; re-raises its construction error.
        build_here: the engine is built on the calling thread before the engine thread exists (in a process
        with no other thread its TP followers can then be forked: rpc.processes.child_start_method)."""
        if build_here:
            try:
                built = self._factory()
            except Exception as error:
                raise RuntimeError(f"engine failed to start: {error}") from error
            self._factory = lambda: built
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("engine did not start in time")
        if self._error is not None:
            raise RuntimeError(f"engine failed to start: {self._error}") from self._error
        assert self.engine is not None
        return self.engine

    def _run(self) -> None:
        try:
            self.engine = self._factory()
        except BaseException as error:  # noqa: BLE001 - reported to start()
            self._error = error
            self._ready.set()
            return
        self._ready.set()
        try:
            self._loop(self.engine)
        finally:
            close = getattr(self.engine, "close", None)
            if close is not None:
                close()

    def _loop(self, engine: E) -> None:
        busy = False
        while True:
            try:
                item = self._commands.get_nowait() if busy else self._commands.get()
            except queue.Empty:
                item = None
            while item is not None:
                if item is _STOP:
                    return
                self._execute(engine, *item)
                try:
                    item = self._commands.get_nowait()
                except queue.Empty:
                    item = None
            try:
                busy = self._work(engine)
            except Exception:  # noqa: BLE001 - a failed step must not kill the serving thread
                logger.exception("engine work failed")
                busy = False

    @staticmethod
    def _execute(engine: E, fn: Callable[[E], object], loop: asyncio.AbstractEventLoop | None,
                 future: asyncio.Future[object] | None) -> None:
        try:
            result = fn(engine)
        except BaseException as error:  # noqa: BLE001 - handed to the awaiting coroutine
            if loop is not None:
                loop.call_soon_threadsafe(_set_exception, future, error)
            return
        if loop is not None:
            loop.call_soon_threadsafe(_set_result, future, result)

    async def call(self, fn: Callable[[E], T]) -> T:
        """Runs fn(engine) on the engine thread and returns its result."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._commands.put((fn, loop, future))
        return await future

    def post(self, fn: Callable[[E], object]) -> None:
        """Runs fn(engine) on the engine thread without waiting (errors are logged)."""
        self._commands.put((_logged(fn), None, None))

    def wake(self) -> None:
        """Makes a sleeping thread call work() again."""
        self._commands.put((lambda engine: None, None, None))

    def stop(self, timeout: float | None = 30.0) -> None:
        """Finishes queued commands, then closes the engine (stopping its TP followers)."""
        if self._thread.is_alive():
            self._commands.put(_STOP)
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("engine thread did not stop within %s s", timeout)


def _logged(fn: Callable[[E], object]) -> Callable[[E], object]:
    def run(engine: E) -> object:
        try:
            return fn(engine)
        except Exception:  # noqa: BLE001
            logger.exception("engine command failed")
            return None

    return run


def _set_result(future: asyncio.Future[T], result: T) -> None:
    if not future.done():
        future.set_result(result)


def _set_exception(future: asyncio.Future[object], error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
