"""The decode worker's request handling, independent of gRPC: a thin façade over the reservation book
(decode_worker/leases.py) and the engine's output streams (decode_worker/streams.py).

reserve  -> allocates the prompt's pages (and, for linear attention, a state slot) under a lease and
            registers it with the KV receiver of the requested transport (its Destination tells
            prefill where to write). Answered on the event loop, without waiting for the engine step.
decode   -> claims the lease, waits for the KV to be complete and verified, hands the request to the
            engine (add_prefilled) and yields its tokens as the engine thread produces them.
release  -> frees whatever the request holds (unclaimed lease or running request). Idempotent.
A sweeper frees the pages (and state slots) of leases nobody claimed in time.

If the running requests' growth still runs out of pages, the engine preempts the newest running request
and recomputes it later (its stream just pauses)."""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from decode_worker.admission import DecodeUpdate, headroom
from decode_worker.config import DecodeWorkerConfig
from decode_worker.leases import ReservationBook
from decode_worker.streams import Streams
from engine.config_base import alias
from engine.sampling_params import SamplingParams
from kvtransfer.checksum import INLINE_CHECKSUM_BYTES
from kvtransfer.destination import Destination, TransportKind
from kvtransfer.errors import KVTransferError
from kvtransfer.transport import KVReceiver
from rpc.convert import MAX_STREAM_INTERVAL
from rpc.engine_thread import EngineThread
from rpc.status import FailedPrecondition, InvalidArgument

logger = logging.getLogger(__name__)


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


class DecodeService:
    """receivers_factory(engine) -> {transport: KVReceiver}, built once the engine (and its pools) exist."""

    def __init__(self, config: DecodeWorkerConfig, receivers_factory: Callable[[Any], Mapping[TransportKind, KVReceiver]],
                 engine_factory: Callable[[], Any] | None = None) -> None:
        self.config = config
        self._receivers_factory = receivers_factory
        self.receivers: Mapping[TransportKind, KVReceiver] = {}
        factory = engine_factory or (lambda: _build_engine(config))
        self._engine: EngineThread[Any] = EngineThread(factory, self._work, name="decode-engine")
        self._streams = Streams(self._engine, self._publish)
        self._book: ReservationBook | None = None
        self._snapshot = LoadSnapshot()
        self._sweeper: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self.engine: Any = None

    # --- lifecycle ----------------------------------------------------------------------------------
    async def start(self) -> None:
        self._streams.start(asyncio.get_running_loop())
        self.engine = await asyncio.to_thread(self._engine.start)
        self.receivers = dict(self._receivers_factory(self.engine))
        self._book = ReservationBook(self.config, self.engine, self.receivers)
        await self._engine.call(self._publish)
        self._sweeper = asyncio.create_task(self._book.sweep())

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        self._streams.fail_all("decode worker shutting down")
        await asyncio.to_thread(self._engine.stop)

    @property
    def book(self) -> ReservationBook:
        if self._book is None:
            raise RuntimeError("DecodeService.start() has not run")
        return self._book

    @property
    def load(self) -> LoadSnapshot:
        """The engine figures published after its last step; free pages and slots read now (they change
        on this loop too), with the reservation book's leases."""
        if self._book is None:
            return self._snapshot
        leases = self._book.unclaimed()
        return replace(self._snapshot, free_pages=self.engine.num_free_pages,
                       free_state_slots=self.engine.num_free_state_slots, leases=len(leases),
                       leased_pages=sum(len(lease.page_ids) for lease in leases), requests_total=self._book.granted)

    @property
    def lease_expiries(self) -> int:
        return self._book.expiries if self._book is not None else 0

    engine_steps = alias("_streams.engine_steps")
    engine_step_tokens = alias("_streams.engine_step_tokens")

    # --- engine thread --------------------------------------------------------------------------------
    def _work(self, engine: Any) -> bool:
        return self._streams.work(engine)

    def _publish(self, engine: Any) -> None:
        running = engine.num_running
        self._snapshot = LoadSnapshot(
            free_pages=engine.num_free_pages, total_pages=engine.allocator.num_pages, running=running,
            waiting=engine.num_waiting, page_size=engine.config.page_size, tp_size=engine.config.tp_size,
            headroom_pages=headroom(running, self.config.spec_block_size, engine.config.page_size),
            free_state_slots=engine.num_free_state_slots, total_state_slots=engine.num_state_slots,
        )

    # --- requests -----------------------------------------------------------------------------------
    async def reserve(self, request_id: str, num_prompt_tokens: int, max_new_tokens: int,
                      transport: TransportKind, ttl_s: float | None = None) -> Destination:
        """Leases the prompt's pages (ReservationBook.reserve): done on this loop, so neither an engine step
        in progress nor a cancellation can leave it half done."""
        return self.book.reserve(request_id, num_prompt_tokens, max_new_tokens, transport, ttl_s)

    def abandon(self, request_id: str, lease_id: str) -> None:
        """The Reserve answer carrying lease_id never reached its caller: free the lease now."""
        if self.book.release_unclaimed(request_id, lease_id):
            logger.info("reservation of %s was not delivered; freed it", request_id)

    async def decode(self, request_id: str, lease_id: str, prompt_ids: list[int], first_token: int,
                     params: SamplingParams, stream_interval: int = 1) -> AsyncIterator[DecodeUpdate]:
        """Yields the request's tokens: an update after every engine step that produced some, or (with
        stream_interval > 1) once at least that many tokens are ready, and always when it finishes."""
        if not 0 <= stream_interval <= MAX_STREAM_INTERVAL:
            raise InvalidArgument("stream_interval", f"must be in 0..{MAX_STREAM_INTERVAL}, got {stream_interval}")
        book = self.book
        held = book.claim(request_id, lease_id, len(prompt_ids))
        self._streams.open(request_id)
        try:
            if held.receiver.admit_now(request_id, INLINE_CHECKSUM_BYTES) is None:  # else: no thread hop
                await asyncio.to_thread(held.receiver.admit, request_id, self.config.admit_timeout_s)
        except BaseException as error:  # not usable, or cancelled while waiting: the claimed pages are ours to free
            self._streams.close(request_id)
            book.drop(request_id, free=True)
            if isinstance(error, KVTransferError):
                raise FailedPrecondition(f"KV of request {request_id} not usable: {error}") from error
            raise
        pages, slot = list(held.lease.page_ids), held.lease.state_slot

        def add(engine: Any) -> None:
            try:
                engine.add_prefilled(request_id, list(prompt_ids), first_token, pages, params, slot)
            except Exception:
                engine.free_reservation(pages, slot)
                raise
            self._streams.force_step = True  # emits the request even if it finished on its first token

        try:
            await self._engine.call(add)
        except BaseException as error:
            self._streams.close(request_id)
            book.forget(request_id)
            if isinstance(error, asyncio.CancelledError):  # the command still runs: abort after it (FIFO) frees the pages
                self._engine.post(lambda engine: self._streams.abort(engine, request_id))
            raise
        try:
            async with contextlib.aclosing(self._streams.stream(request_id, max(1, stream_interval))) as updates:
                async for update in updates:
                    yield update
        finally:
            book.forget(request_id)

    async def release(self, request_id: str) -> bool:
        held = self.book.get(request_id)
        if held is None:
            return False
        if not held.claimed:
            return self.book.release_unclaimed(request_id)
        await self._engine.call(lambda engine: self._streams.abort(engine, request_id))
        return True

    def release_soon(self, request_id: str) -> None:
        """release() from a callback (e.g. when a Decode stream is cancelled)."""
        task = asyncio.get_running_loop().create_task(self.release(request_id))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _build_engine(config: DecodeWorkerConfig) -> Any:
    from engine.llm_engine import LLMEngine

    return LLMEngine(config.engine_config())
