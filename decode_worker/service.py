"""The decode worker's request handling, independent of gRPC: a thin façade over the reservation book
(decode_worker/leases.py) and the engine's output streams (decode_worker/streams.py).

reserve  -> allocates the prompt's pages (and, for linear attention, a state slot) under a lease and
            registers it with the KV receiver of the requested transport (its Destination tells
            prefill where to write). Answered on the event loop, without waiting for the engine step.
run_decode -> claims the lease, waits for the KV to be complete and verified, hands the request to the
            engine (add_prefilled) and hands its tokens to the caller's sink as each engine step is delivered.
release  -> frees whatever the request holds (unclaimed lease or running request). Idempotent.
A sweeper frees the pages (and state slots) of leases nobody claimed in time.

If the running requests' growth still runs out of pages, the engine preempts the newest running request
and recomputes it later (its stream just pauses).

The engine runs in an engine process of its own (process_port.ProcessPort), where this process's event loop
cannot take the GIL from the step loop (tests may hand in another EnginePort, e.g. one running the engine on
a thread of theirs).
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import replace

from decode_worker.admission import DecodeUpdate
from decode_worker.config import DecodeWorkerConfig
from decode_worker.engine_api import EngineFigures, EnginePort, LoadSnapshot
from decode_worker.leases import ReservationBook
from decode_worker.process_port import ProcessPort
from decode_worker.streams import Sink, Streams, updates_of
from engine.runtime.reserved_prompts import ReservedHit
from engine.cache.kv_events import KVEventLog
from engine.sampling_params import SamplingParams
from kvtransfer.checksum import INLINE_CHECKSUM_BYTES
from kvtransfer.destination import Destination, TransportKind
from kvtransfer.errors import KVTransferError
from kvtransfer.transport import KVReceiver
from rpc.convert import MAX_STREAM_INTERVAL
from rpc.status import FailedPrecondition, InvalidArgument

__all__ = ["DecodeService", "LoadSnapshot"]
logger = logging.getLogger(__name__)


class DecodeService:
    """receivers_factory(engine) -> {transport: KVReceiver}, built once the engine (and its pools) exist.
    on_engine_lost(reason): the engine process died while serving (its streams have failed already).
    port_factory (tests): where the engine runs instead of an engine process, given the service's Streams."""

    def __init__(self, config: DecodeWorkerConfig,
                 receivers_factory: Callable[[EngineFigures], Mapping[TransportKind, KVReceiver]],
                 on_engine_lost: Callable[[str], None] | None = None,
                 port_factory: Callable[[Streams], EnginePort] | None = None) -> None:
        self.config = config
        self._receivers_factory = receivers_factory
        self.receivers: Mapping[TransportKind, KVReceiver] = {}
        self._streams = Streams(self._abort_soon)
        self._port: EnginePort = (port_factory(self._streams) if port_factory is not None
                                  else ProcessPort(config, self._streams, on_engine_lost))
        self._book: ReservationBook | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[bool]] = set()
        self._engine: EngineFigures | None = None

    # --- lifecycle ----------------------------------------------------------------------------------
    async def start(self) -> None:
        self._engine = await self._port.start()
        self.receivers = dict(self._receivers_factory(self._engine))
        self._book = ReservationBook(self.config, self._engine, self.receivers, self._port)
        self._sweeper = asyncio.create_task(self._book.sweep())

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        self._streams.fail_all("decode worker shutting down")
        await self._port.stop()

    @property
    def book(self) -> ReservationBook:
        if self._book is None:
            raise RuntimeError("DecodeService.start() has not run")
        return self._book

    @property
    def engine(self) -> EngineFigures:
        if self._engine is None:
            raise RuntimeError("DecodeService.start() has not run")
        return self._engine

    @property
    def load(self) -> LoadSnapshot:
        """The engine figures published after its last step; free pages and slots read now (they change
        on this loop too), with the reservation book's leases."""
        snapshot = self._port.snapshot()
        if self._book is None:
            return snapshot
        leases, standing = self._book.unclaimed(), self._book.unclaimed(standing=True)
        return replace(snapshot, free_pages=self.engine.num_free_pages,
                       free_state_slots=self.engine.num_free_state_slots, leases=len(leases),
                       leased_pages=sum(len(lease.page_ids) for lease in leases), requests_total=self._book.granted,
                       standing_leases=len(standing), standing_pages=sum(len(lease.page_ids) for lease in standing),
                       standing_state_slots=sum(lease.state_slot is not None for lease in standing))

    @property
    def lease_expiries(self) -> int:
        return self._book.expiries if self._book is not None else 0

    def book_figure(self, name: str) -> int:
        """A counter of the reservation book (expiries, cached_tokens, local_prefills); 0 before start."""
        return getattr(self._book, name) if self._book is not None else 0

    @property
    def port(self) -> EnginePort:
        """Where the engine runs (its engine_steps / engine_step_tokens: batch occupancy)."""
        return self._port

    @property
    def kv_events(self) -> KVEventLog:
        """The engine's prefix cache events as this process mirrors them (an empty log for a port without)."""
        log = getattr(self._port, "kv_events", None)
        if log is None:
            log = self.__dict__.setdefault("_no_kv_events", KVEventLog())
        return log

    def _abort_soon(self, request_id: str) -> None:
        self._port.abort_soon(request_id)

    # --- requests -----------------------------------------------------------------------------------
    async def reserve(self, request_id: str, num_prompt_tokens: int, max_new_tokens: int,
                      transport: TransportKind, ttl_s: float | None = None, standing: bool = False,
                      prompt_ids: list[int] | None = None) -> Destination:
        """Leases the prompt's pages (ReservationBook.reserve: with prompt_ids, from the prefix cache's hit on),
        without waiting for the engine step in progress."""
        return await self.book.reserve(request_id, num_prompt_tokens, max_new_tokens, transport, ttl_s, standing,
                                       prompt_ids)

    def abandon(self, request_id: str, lease_id: str) -> None:
        """The Reserve answer carrying lease_id never reached its caller: free the lease now."""
        if self.book.release_unclaimed(request_id, lease_id):
            logger.info("reservation of %s was not delivered; freed it", request_id)

    async def run_decode(self, request_id: str, lease_id: str, prompt_ids: list[int], first_token: int,
                         params: SamplingParams, stream_interval: int, sink: Sink, local: bool = False) -> None:
        """Claims the lease, admits the KV, adds the request to the engine and returns once it finished; its
        updates go to sink as the engine's steps are delivered: after every step that produced tokens, or
        (stream_interval > 1) once at least that many are ready, and always when it finishes. Cancelled (the
        caller left early): the request is aborted and its pages freed. local (DecodeRequest.prefill_locally): no
        KV comes; the engine prefills the prompt after the lease's cached pages itself and the first update
        carries the first token (first_token is ignored)."""
        if not 0 <= stream_interval <= MAX_STREAM_INTERVAL:
            raise InvalidArgument("stream_interval", f"must be in 0..{MAX_STREAM_INTERVAL}, got {stream_interval}")
        book = self.book
        held = book.claim(request_id, lease_id, len(prompt_ids), params.max_new_tokens)
        self._streams.open(request_id, max(1, stream_interval), sink, skip_first=not local)
        lease = held.lease
        try:
            if local:
                held.receiver.cancel(request_id)  # nothing will be written: its completion slot goes back now
                book.local_prefills += 1
            elif held.receiver.admit_now(request_id, INLINE_CHECKSUM_BYTES) is None:  # else: no thread hop
                await asyncio.to_thread(held.receiver.admit, request_id, self.config.admit_timeout_s)
        except BaseException as error:  # not usable, or cancelled while waiting: the claimed pages are ours to free
            self._streams.close(request_id)
            book.drop(request_id, free=True)
            if isinstance(error, KVTransferError):
                raise FailedPrecondition(f"KV of request {request_id} not usable: {error}") from error
            raise
        try:  # on failure the port has freed the pages (or, if cancelled, aborts the request once added)
            await self._port.add(request_id, list(prompt_ids), first_token, list(lease.page_ids), params,
                                 lease.state_slot, ReservedHit(lease.cached_pages, lease.checkpoint,
                                                               lease.checkpoint_pages), local)
        except BaseException:
            self._streams.close(request_id)
            book.forget(request_id)
            raise
        try:
            await self._streams.run(request_id)
        finally:
            book.forget(request_id)

    def decode(self, request_id: str, lease_id: str, prompt_ids: list[int], first_token: int,
               params: SamplingParams, stream_interval: int = 1) -> AsyncIterator[DecodeUpdate]:
        """run_decode's updates as an async iterator (tests, benchmarks); leaving early aborts the request."""
        return updates_of(lambda sink: asyncio.ensure_future(
            self.run_decode(request_id, lease_id, prompt_ids, first_token, params, stream_interval, sink)))

    async def release(self, request_id: str) -> bool:
        held = self.book.get(request_id)
        if held is None:
            return False
        if not held.claimed:
            return self.book.release_unclaimed(request_id)
        await self._port.abort(request_id)
        return True

    def release_soon(self, request_id: str) -> None:
        """release() from a callback (e.g. when a Decode stream is cancelled)."""
        task = asyncio.get_running_loop().create_task(self.release(request_id))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
