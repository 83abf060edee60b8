"""A test helper: the decode engine on an engine thread of the test's own process (rpc/engine_thread.py), an
EnginePort (decode_worker/engine_api.py) like the worker's engine process, so that tests can reach into the
engine between steps (service._port.engine_thread). Each step's outputs are queued in an outbox and the event
loop is woken once per batch of steps; reservations are allocated on the event loop under the pool lock."""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

from decode_worker.config import DecodeWorkerConfig
from decode_worker.engine_api import DecodeEngine, EnginePort, LoadSnapshot, snapshot_of
from decode_worker.engine_process import build_engine
from decode_worker.leases import allocate_admitted, free_lease
from decode_worker.step_loop import StepLoop
from decode_worker.streams import Streams
from engine.runtime.outputs import StepOutput
from engine.runtime.reserved_prompts import NO_HIT, PromptReservation, ReservedHit
from engine.sampling_params import SamplingParams
from rpc.engine_thread import EngineThread


def thread_port(config: DecodeWorkerConfig,
                engine_factory: Callable[[], DecodeEngine] | None = None) -> Callable[[Streams], EnginePort]:
    """DecodeService(port_factory=...): the engine of `config` (or engine_factory's) on a thread of this process."""
    return lambda streams: ThreadPort(engine_factory or (lambda: build_engine(config)), streams,
                                      config.spec_block_size)


class ThreadPort:
    """The engine on an engine thread: each step's outputs are queued in an outbox and the event loop is
    woken once per batch of steps (not per output); a failed step aborts the open streams' requests."""

    def __init__(self, engine_factory: Callable[[], DecodeEngine], streams: Streams, spec_block_size: int) -> None:
        self.engine_thread: EngineThread[DecodeEngine] = EngineThread(engine_factory, self._work, name="decode-engine")
        self._streams = streams
        self._block = spec_block_size
        self._steps = StepLoop(self._hand_over, self._on_failure, self._publish)
        self._outbox: list[StepOutput] = []  # step outputs the event loop has not delivered yet
        self._outbox_lock = threading.Lock()
        self._delivery_scheduled = False  # under _outbox_lock: a _deliver is queued on the loop
        self._loop: asyncio.AbstractEventLoop | None = None
        self._snapshot = LoadSnapshot()
        self.engine: DecodeEngine | None = None

    @property
    def engine_steps(self) -> int:
        return self._steps.engine_steps

    @property
    def engine_step_tokens(self) -> int:
        return self._steps.engine_step_tokens

    def snapshot(self) -> LoadSnapshot:
        """The engine figures published after its last step."""
        return self._snapshot

    async def start(self) -> DecodeEngine:
        self._loop = asyncio.get_running_loop()
        self.engine = await asyncio.to_thread(self.engine_thread.start)
        await self.engine_thread.call(self._publish)
        return self.engine

    async def stop(self) -> None:
        await asyncio.to_thread(self.engine_thread.stop)

    # --- reservations: on the event loop, under the engine's pool lock ---------------------------------
    async def allocate(self, num_tokens: int, pending: int = 0, prompt_ids: list[int] | None = None) -> PromptReservation:
        assert self.engine is not None
        # no await: cancellation cannot split it
        return allocate_admitted(self.engine, num_tokens, self._block, pending, prompt_ids)

    def free(self, page_ids: list[int], state_slot: int | None, checkpoint: int | None = None) -> None:
        assert self.engine is not None
        free_lease(self.engine, page_ids, state_slot, checkpoint)

    # --- between steps, on the engine thread -------------------------------------------------------------
    async def add(self, request_id: str, prompt_ids: list[int], first_token: int, page_ids: list[int],
                  params: SamplingParams, state_slot: int | None, hit: ReservedHit = NO_HIT,
                  local: bool = False) -> None:
        try:
            await self.engine_thread.call(
                lambda engine: self._steps.add(engine, request_id, prompt_ids, first_token, page_ids, params,
                                               state_slot, hit, local))
        except asyncio.CancelledError:  # the command still runs: an abort after it (FIFO) frees the pages
            self.abort_soon(request_id)
            raise

    def abort_soon(self, request_id: str) -> None:
        self.engine_thread.post(lambda engine: self._steps.abort(engine, request_id))

    async def abort(self, request_id: str) -> None:
        await self.engine_thread.call(lambda engine: self._steps.abort(engine, request_id))

    # --- engine thread ---------------------------------------------------------------------------------
    def _work(self, engine: DecodeEngine) -> bool:
        return self._steps.work(engine)

    def _publish(self, engine: DecodeEngine) -> None:
        self._snapshot = snapshot_of(engine, self._block)

    def _hand_over(self, outputs: list[StepOutput]) -> None:
        """Queues a step's outputs for the event loop, waking it only when no delivery is pending yet
        (a loop that fell behind takes several steps' outputs in one wake-up)."""
        with self._outbox_lock:
            self._outbox += outputs
            wake, self._delivery_scheduled = not self._delivery_scheduled, True
        if wake:
            assert self._loop is not None
            self._loop.call_soon_threadsafe(self._deliver)

    def _on_failure(self, engine: DecodeEngine, error: Exception) -> None:
        """The failure reaches the streams after the earlier steps' outputs and before any later one (the
        aborted requests' "abort" finishes of the next step), as the engine process's StepFailed message does."""
        failed = self._streams.open_ids()  # a copy of the keys: safe from this thread
        with self._outbox_lock:
            earlier, self._outbox = self._outbox, []
        StepLoop.abort_each(engine, failed)
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._fail_streams, earlier, failed, error)

    # --- event loop ------------------------------------------------------------------------------------
    def _deliver(self) -> None:
        with self._outbox_lock:
            outputs, self._outbox, self._delivery_scheduled = self._outbox, [], False
        self._streams.deliver(outputs)

    def _fail_streams(self, earlier: list[StepOutput], request_ids: list[str], error: Exception) -> None:
        self._streams.deliver(earlier)  # outputs of earlier steps go first
        self._streams.fail(request_ids, f"engine step failed: {error}")
