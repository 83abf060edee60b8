"""Where the decode worker's engine runs, behind one interface the DecodeService uses: ThreadPort runs the
LLMEngine on an engine thread of this process (rpc/engine_thread.py); process_port.ProcessPort runs it in
an engine process of its own. Both give the service the engine (or its view), load figures, reservation
allocation without waiting for a step, add / abort between steps, and feed a Streams with step outputs."""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from decode_worker.admission import headroom
from decode_worker.leases import allocate_admitted
from decode_worker.step_loop import StepLoop
from decode_worker.streams import Streams
from engine.config_base import alias
from engine.sampling_params import SamplingParams
from rpc.engine_thread import EngineThread


@dataclass(frozen=True)
class LoadSnapshot:
    free_pages: int = 0
    total_pages: int = 0
    running: int = 0
    waiting: int = 0
    leases: int = 0
    leased_pages: int = 0
    page_size: int = 16
    tp_size: int = 1
    headroom_pages: int = 0
    requests_total: int = 0
    free_state_slots: int = 0  # linear attention: state slots neither used nor leased (0 for pure MLA)
    total_state_slots: int = 0
    standing_leases: int = 0  # of `leases`: unclaimed standing leases (gateways' spares)
    standing_pages: int = 0  # of `leased_pages`: the pages they hold
    standing_state_slots: int = 0  # the state slots they hold
    checkpoints: int = 0  # recurrent-state checkpoints the prefix cache holds (0 without one)
    checkpoint_slots: int = 0  # the prefix cache's checkpoint pool size (0 without one)


def snapshot_of(engine: Any, spec_block_size: int) -> LoadSnapshot:
    """The engine's figures now (an LLMEngine, or a process port's EngineView)."""
    running, page_size = engine.num_running, engine.config.page_size
    return LoadSnapshot(
        free_pages=engine.num_free_pages, total_pages=engine.allocator.num_pages, running=running,
        waiting=engine.num_waiting, page_size=page_size, tp_size=engine.config.tp_size,
        headroom_pages=headroom(running, spec_block_size, page_size),
        free_state_slots=engine.num_free_state_slots, total_state_slots=engine.num_state_slots,
    )


class ThreadPort:
    """The engine on an engine thread: each step's outputs are queued in an outbox and the event loop is
    woken once per batch of steps (not per output); a failed step aborts the open streams' requests."""

    def __init__(self, engine_factory: Callable[[], Any], streams: Streams, spec_block_size: int) -> None:
        self.engine_thread: EngineThread[Any] = EngineThread(engine_factory, self._work, name="decode-engine")
        self._streams = streams
        self._block = spec_block_size
        self._steps = StepLoop(self._hand_over, self._on_failure, self._publish)
        self._outbox: list[Any] = []  # step outputs the event loop has not delivered yet
        self._outbox_lock = threading.Lock()
        self._delivery_scheduled = False  # under _outbox_lock: a _deliver is queued on the loop
        self._loop: asyncio.AbstractEventLoop | None = None
        self._snapshot = LoadSnapshot()
        self.engine: Any = None

    engine_steps = alias("_steps.engine_steps")  # steps that produced output, and the tokens they produced
    engine_step_tokens = alias("_steps.engine_step_tokens")

    def snapshot(self) -> LoadSnapshot:
        """The engine figures published after its last step."""
        return self._snapshot

    async def start(self) -> Any:
        self._loop = asyncio.get_running_loop()
        self.engine = await asyncio.to_thread(self.engine_thread.start)
        await self.engine_thread.call(self._publish)
        return self.engine

    async def stop(self) -> None:
        await asyncio.to_thread(self.engine_thread.stop)

    # --- reservations: on the event loop, under the engine's pool lock ---------------------------------
    async def allocate(self, num_tokens: int, pending: int = 0) -> tuple[list[int], int | None]:
        return allocate_admitted(self.engine, num_tokens, self._block, pending)  # no await: cancellation cannot split it

    def free(self, page_ids: list[int], state_slot: int | None) -> None:
        self.engine.free_reservation(page_ids, state_slot)

    # --- between steps, on the engine thread -------------------------------------------------------------
    async def add(self, request_id: str, prompt_ids: list[int], first_token: int, page_ids: list[int],
                  params: SamplingParams, state_slot: int | None) -> None:
        try:
            await self.engine_thread.call(
                lambda engine: self._steps.add(engine, request_id, prompt_ids, first_token, page_ids, params, state_slot))
        except asyncio.CancelledError:  # the command still runs: an abort after it (FIFO) frees the pages
            self.abort_soon(request_id)
            raise

    def abort_soon(self, request_id: str) -> None:
        self.engine_thread.post(lambda engine: self._steps.abort(engine, request_id))

    async def abort(self, request_id: str) -> None:
        await self.engine_thread.call(lambda engine: self._steps.abort(engine, request_id))

    # --- engine thread ---------------------------------------------------------------------------------
    def _work(self, engine: Any) -> bool:
        return self._steps.work(engine)

    def _publish(self, engine: Any) -> None:
        self._snapshot = snapshot_of(engine, self._block)

    def _hand_over(self, outputs: list[Any]) -> None:
        """Queues a step's outputs for the event loop, waking it only when no delivery is pending yet
        (a loop that fell behind takes several steps' outputs in one wake-up)."""
        with self._outbox_lock:
            self._outbox += outputs
            wake, self._delivery_scheduled = not self._delivery_scheduled, True
        if wake:
            assert self._loop is not None
            self._loop.call_soon_threadsafe(self._deliver)

    def _on_failure(self, engine: Any, error: Exception) -> None:
        failed = self._streams.open_ids()  # a copy of the keys: safe from this thread
        StepLoop.abort_each(engine, failed)
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._fail_streams, failed, error)

    # --- event loop ------------------------------------------------------------------------------------
    def _deliver(self) -> None:
        with self._outbox_lock:
            outputs, self._outbox, self._delivery_scheduled = self._outbox, [], False
        self._streams.deliver(outputs)

    def _fail_streams(self, request_ids: list[str], error: Exception) -> None:
        self._deliver()  # outputs of earlier steps go first
        self._streams.fail(request_ids, f"engine step failed: {error}")
