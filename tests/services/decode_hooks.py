"""Hooks into a DecodeService's engine for tests: hold or fail a decode step, block the engine thread, and
mark a reservation's KV complete as a prefill worker would."""
from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from engine.runtime.forward_batch import ForwardMode
from engine.runtime.step_plan import TargetPlan
from kvtransfer.destination import Destination
from kvtransfer.layout import KVLayout
from kvtransfer.shm_transport import ShmWriter


class NextDecodeForward:
    """Wraps the leader's execute: once armed, the next DECODE forward first runs `action` (which may raise:
    a failure mid-step, or block: a long step), then the forward itself."""

    def __init__(self, execute: Any, action: Callable[[], None]) -> None:
        self._execute = execute
        self._action = action
        self.armed = threading.Event()
        self.fired = threading.Event()

    def __call__(self, plan: Any) -> Any:
        if isinstance(plan, TargetPlan) and plan.mode == ForwardMode.DECODE and self.armed.is_set():
            self.armed.clear()
            self.fired.set()
            self._action()
        return self._execute(plan)


def mark_kv_complete(engine: Any, destination: Destination) -> None:
    """Marks the reservation's (zeroed) pages complete on every rank, as a finished prefill transfer would."""
    writer = ShmWriter(KVLayout.from_cache_shape(engine.cache_shape))
    try:
        for rank in range(destination.num_ranks):
            writer.open(destination, rank, in_place=True).finish()
    finally:
        writer.close()


@asynccontextmanager
async def engine_thread_blocked(service: Any) -> AsyncIterator[threading.Event]:
    """Blocks the service's engine thread (as a long step would) until the block exits; yields the Event
    that releases it, so a test can check it was not set yet."""
    busy, gate = threading.Event(), threading.Event()

    def block(engine: object) -> None:
        busy.set()
        gate.wait(120)

    service._port.engine_thread.post(block)
    try:
        assert await asyncio.to_thread(busy.wait, 60), "the engine thread never ran the blocking command"
        yield gate
    finally:
        gate.set()
