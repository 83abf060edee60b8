"""The decode worker's request handling, independent of gRPC.

reserve  -> allocates the prompt's pages under a lease and registers it with the KV receiver of the
            requested transport (its Destination tells prefill where to write).
decode   -> claims the lease, waits for the KV to be complete and verified, hands the request to the
            engine (add_prefilled) and yields its tokens as the engine thread produces them.
release  -> frees whatever the request holds (unclaimed lease or running request). Idempotent.
A sweeper frees the pages of leases nobody claimed in time.

Page-exhaustion policy: reserve keeps `headroom_pages` free for the running requests to grow (one
speculative block each) and answers ResourceExhausted instead of eating into them; if growth still runs
out, the engine preempts the newest running request and recomputes it later (its stream just pauses)."""
from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from decode_worker.admission import DecodeUpdate, admits, fits_ever, headroom, merge_outputs, new_tokens
from decode_worker.config import DecodeWorkerConfig
from engine.sampling_params import SamplingParams
from kvtransfer.destination import Destination, TransportKind
from kvtransfer.errors import KVTransferError, LeaseExpired, UnknownTransfer
from kvtransfer.leases import Lease, LeaseTable
from kvtransfer.transport import KVReceiver
from rpc.convert import MAX_STREAM_INTERVAL
from rpc.engine_thread import EngineThread
from rpc.status import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted

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


class _Mailbox:
    """What the engine produced for one stream and its reader has not taken yet: a list and at most one
    waiting reader (lighter than an asyncio.Queue: one wake-up per engine step, whatever piled up)."""

    def __init__(self) -> None:
        self._items: list[Any] = []
        self._waiter: asyncio.Future[None] | None = None

    def put(self, item: Any) -> None:
        self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def take(self) -> list[Any]:
        """Everything queued so far (waits for at least one item)."""
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items, self._items = self._items, []
        return items


@dataclass
class _Entry:
    lease: Lease
    receiver: KVReceiver
    num_prompt_tokens: int
    first_token: int | None = None  # set once claimed (running)
    mailbox: _Mailbox | None = None
    done: bool = False


class _EngineFailed(Exception):
    pass


class DecodeService:
    """receivers_factory(engine) -> {transport: KVReceiver}, built once the engine (and its pools) exist."""

    def __init__(self, config: DecodeWorkerConfig, receivers_factory: Callable[[Any], Mapping[TransportKind, KVReceiver]],
                 engine_factory: Callable[[], Any] | None = None) -> None:
        self.config = config
        self._receivers_factory = receivers_factory
        self.receivers: Mapping[TransportKind, KVReceiver] = {}
        self._leases = LeaseTable(grace_s=config.lease_grace_s)
        self._entries: dict[str, _Entry] = {}
        self._force_step = False  # engine thread only
        self._outbox: list[Any] = []  # step outputs the event loop has not dispatched yet
        self._outbox_lock = threading.Lock()
        self._dispatch_scheduled = False  # under _outbox_lock: a _dispatch is queued on the loop
        factory = engine_factory or (lambda: _build_engine(config))
        self._engine: EngineThread[Any] = EngineThread(factory, self._work, name="decode-engine")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._snapshot = LoadSnapshot()
        self._sweeper: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._reservations = 0
        self._reserving: dict[str, bool] = {}  # request id -> abandoned (cancelled / released meanwhile)
        self.lease_expiries = 0
        self.engine_steps = 0  # engine steps that produced output, and the tokens they produced (batch occupancy)
        self.engine_step_tokens = 0
        self.engine: Any = None

    # --- lifecycle ----------------------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.engine = await asyncio.to_thread(self._engine.start)
        self.receivers = dict(self._receivers_factory(self.engine))
        self._max_context = self.engine.model_config.max_position_embeddings
        await self._engine.call(self._publish)
        self._sweeper = asyncio.create_task(self._sweep_leases())

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        for entry in list(self._entries.values()):
            if entry.mailbox is not None:
                entry.mailbox.put(_EngineFailed("decode worker shutting down"))
        await asyncio.to_thread(self._engine.stop)

    @property
    def load(self) -> LoadSnapshot:
        """The engine figures published after its last step, with this loop's own lease bookkeeping."""
        leases = [entry.lease for entry in self._entries.values() if entry.first_token is None]
        return replace(self._snapshot, leases=len(leases), leased_pages=sum(len(lease.page_ids) for lease in leases),
                       requests_total=self._reservations)

    # --- engine thread --------------------------------------------------------------------------------
    def _publish(self, engine: Any) -> None:
        running = engine.num_running
        self._snapshot = LoadSnapshot(
            free_pages=engine.num_free_pages, total_pages=engine.allocator.num_pages, running=running,
            waiting=engine.num_waiting, page_size=engine.config.page_size, tp_size=engine.config.tp_size,
            headroom_pages=headroom(running, self.config.spec_block_size, engine.config.page_size),
        )

    def _work(self, engine: Any) -> bool:
        if self._force_step or engine.has_work():
            self._force_step = False
            try:
                outputs = engine.step()
            except Exception as error:  # noqa: BLE001 - fail the streams, keep serving
                logger.exception("engine step failed; aborting running requests")
                self._abort_all(engine, error)
                outputs = []
            if outputs:
                self.engine_steps += 1
                self.engine_step_tokens += sum(len(output.new_token_ids) for output in outputs)
                self._hand_over(outputs)
        self._publish(engine)
        return engine.has_work()

    def _hand_over(self, outputs: list[Any]) -> None:
        """Queues a step's outputs for the event loop, waking it only when no dispatch is pending yet
        (a loop that fell behind takes several steps' outputs in one wake-up)."""
        with self._outbox_lock:
            self._outbox += outputs
            wake, self._dispatch_scheduled = not self._dispatch_scheduled, True
        if wake:
            assert self._loop is not None
            self._loop.call_soon_threadsafe(self._dispatch)

    def _abort_all(self, engine: Any, error: Exception) -> None:
        failed = [request_id for request_id, entry in self._entries.items() if entry.first_token is not None]
        for request_id in failed:
            try:
                engine.abort(request_id)
            except Exception:  # noqa: BLE001
                logger.exception("abort of %s failed", request_id)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._fail_streams, failed, error)

    # --- event loop ---------------------------------------------------------------------------------
    def _dispatch(self) -> None:
        with self._outbox_lock:
            outputs, self._outbox, self._dispatch_scheduled = self._outbox, [], False
        entries = self._entries
        for output in outputs:
            entry = entries.get(output.request_id)
            if entry is not None and entry.mailbox is not None:
                entry.mailbox.put(output)

    def _fail_streams(self, request_ids: list[str], error: Exception) -> None:
        self._dispatch()  # outputs of earlier steps go first
        for request_id in request_ids:
            entry = self._entries.get(request_id)
            if entry is not None and entry.mailbox is not None:
                entry.mailbox.put(_EngineFailed(f"engine step failed: {error}"))

    async def reserve(self, request_id: str, num_prompt_tokens: int, max_new_tokens: int,
                      transport: TransportKind, ttl_s: float | None = None) -> Destination:
        """Leases the prompt's pages. ttl_s: how long the lease may stay unclaimed (the caller's deadline;
        None: the configured lease_ttl_s, which also caps it). Cancellation-safe: a Reserve cancelled while
        the engine thread allocates frees what it allocated once the allocation lands."""
        if not request_id:
            raise InvalidArgument("request_id", "is empty")
        if request_id in self._entries or request_id in self._reserving:
            raise AlreadyExists(f"request {request_id} already holds a reservation on this worker")
        if num_prompt_tokens <= 0 or max_new_tokens <= 0:
            raise InvalidArgument("num_prompt_tokens", "prompt and max_new_tokens must be positive")
        if num_prompt_tokens + max_new_tokens > self._max_context:
            raise InvalidArgument("max_new_tokens", f"prompt + max_new_tokens exceeds the model context {self._max_context}")
        receiver = self.receivers.get(transport)
        if receiver is None:
            raise FailedPrecondition(f"transport {TransportKind(transport).name} is not served by this decode worker")
        if not fits_ever(num_prompt_tokens, max_new_tokens, self.config.spec_block_size, self.engine.config.page_size,
                         self._snapshot.total_pages):
            raise InvalidArgument("max_new_tokens", f"the request could never fit the pool of {self._snapshot.total_pages} pages")
        ttl = self.config.lease_ttl_s if ttl_s is None else min(self.config.lease_ttl_s, max(ttl_s, 0.001))
        self._reserving[request_id] = False
        grant = asyncio.ensure_future(self._grant(request_id, num_prompt_tokens, receiver, ttl))
        try:
            return await asyncio.shield(grant)
        except asyncio.CancelledError:  # the caller left: whatever the grant reserves is released on landing
            if not grant.done():
                self._reserving[request_id] = True
            elif not grant.cancelled() and grant.exception() is None:
                self._release_lease(request_id)
            raise

    async def _grant(self, request_id: str, num_prompt_tokens: int, receiver: KVReceiver, ttl_s: float) -> Destination:
        """Allocates, leases and registers; runs to completion even when its Reserve is cancelled, and
        then (or when Release arrived meanwhile) gives everything back at once."""
        try:
            page_ids = await self._engine.call(lambda engine: self._allocate(engine, num_prompt_tokens))
            lease = self._leases.grant(request_id, page_ids, ttl_s)
            try:
                destination = receiver.expect(lease, num_prompt_tokens)
            except BaseException:
                self._leases.release(lease.lease_id)
                self._engine.post(lambda engine: (engine.free_pages(page_ids), self._publish(engine)))
                raise
            self._entries[request_id] = _Entry(lease, receiver, num_prompt_tokens)
            self._reservations += 1
        finally:
            abandoned = self._reserving.pop(request_id, False)
        if abandoned:
            logger.info("reservation of %s abandoned (cancelled or released while allocating); freeing it", request_id)
            self._release_lease(request_id)
        return destination

    def _release_lease(self, request_id: str, lease_id: str | None = None) -> bool:
        """Frees an unclaimed lease (of lease_id, when given) at once; False if there is none."""
        entry = self._entries.get(request_id)
        if entry is None or entry.first_token is not None or lease_id not in (None, entry.lease.lease_id):
            return False
        if self._leases.release(entry.lease.lease_id) is not None:
            self._drop(request_id, entry, free=True)
        return True

    def abandon(self, request_id: str, lease_id: str) -> None:
        """The Reserve answer carrying lease_id never reached its caller: free the lease now."""
        if self._release_lease(request_id, lease_id):
            logger.info("reservation of %s was not delivered; freed it", request_id)

    def _allocate(self, engine: Any, num_tokens: int) -> list[int]:
        page_size, block = engine.config.page_size, self.config.spec_block_size
        if not admits(engine.num_free_pages, num_tokens, engine.num_running, block, page_size):
            raise ResourceExhausted(
                f"decode pool full: {engine.num_free_pages} pages free, "
                f"{headroom(engine.num_running, block, page_size)} kept for running requests"
            )
        pages = engine.allocate_pages(num_tokens)
        self._publish(engine)
        return pages

    async def decode(self, request_id: str, lease_id: str, prompt_ids: list[int], first_token: int,
                     params: SamplingParams, stream_interval: int = 1) -> AsyncIterator[DecodeUpdate]:
        """Yields the request's tokens: an update after every engine step that produced some, or (with
        stream_interval > 1) once at least that many tokens are ready, and always when it finishes."""
        if not 0 <= stream_interval <= MAX_STREAM_INTERVAL:
            raise InvalidArgument("stream_interval", f"must be in 0..{MAX_STREAM_INTERVAL}, got {stream_interval}")
        entry = self._entries.get(request_id)
        if entry is None or entry.lease.lease_id != lease_id:
            raise NotFound(f"no reservation {lease_id!r} for request {request_id}")
        if entry.first_token is not None:
            raise AlreadyExists(f"request {request_id} is already decoding")
        if len(prompt_ids) != entry.num_prompt_tokens:
            raise InvalidArgument("token_ids", f"the reservation is for {entry.num_prompt_tokens} prompt tokens, got {len(prompt_ids)}")
        try:
            self._leases.claim(lease_id)
        except (UnknownTransfer, LeaseExpired) as error:
            self._drop(request_id, entry, free=isinstance(error, LeaseExpired))
            raise FailedPrecondition(f"lease of request {request_id}: {error}") from error
        entry.first_token = first_token
        entry.mailbox = _Mailbox()
        try:
            await asyncio.to_thread(entry.receiver.admit, request_id, self.config.admit_timeout_s)
        except KVTransferError as error:
            self._drop(request_id, entry, free=True)
            raise FailedPrecondition(f"KV of request {request_id} not usable: {error}") from error
        except BaseException:  # cancelled while waiting: the claimed pages are still ours to free
            self._drop(request_id, entry, free=True)
            raise
        pages = list(entry.lease.page_ids)

        def add(engine: Any) -> None:
            try:
                engine.add_prefilled(request_id, list(prompt_ids), first_token, pages, params)
            except Exception:
                engine.free_pages(pages)
                raise
            self._force_step = True  # emits the request even if it finished on its first token

        try:
            await self._engine.call(add)
        except asyncio.CancelledError:  # the command still runs: abort after it (FIFO) frees the pages
            self._entries.pop(request_id, None)
            self._engine.post(lambda engine: self._abort(engine, request_id))
            raise
        except Exception:
            self._entries.pop(request_id, None)
            raise
        async for update in self._stream(request_id, entry, max(1, stream_interval)):
            yield update

    async def _stream(self, request_id: str, entry: _Entry, interval: int) -> AsyncIterator[DecodeUpdate]:
        assert entry.mailbox is not None
        skip_first = True
        items: list[Any] = []
        try:
            while True:
                taken = await entry.mailbox.take()  # the reader may have fallen behind: merge what piled up
                for item in taken:
                    if isinstance(item, _EngineFailed):
                        entry.done = True
                        raise item
                items += taken
                if not items[-1].finished and new_tokens(items, skip_first) < interval:
                    continue
                update = merge_outputs(items, skip_first)
                skip_first = skip_first and not any(output.new_token_ids for output in items)
                items = []
                entry.done = update.finished
                if update.finished:  # logged before the last chunk leaves, so the line precedes the reply
                    logger.info("decode finished (%s)", update.finish_reason)
                yield update
                if update.finished:
                    return
        finally:
            self._entries.pop(request_id, None)
            if not entry.done:  # the caller went away (cancel / release): stop generating, free the pages
                logger.info("decode stream of %s ended early; aborting it", request_id)
                self._engine.post(lambda engine: self._abort(engine, request_id))

    def _abort(self, engine: Any, request_id: str) -> None:
        if engine.abort(request_id):
            self._force_step = True

    def _drop(self, request_id: str, entry: _Entry, free: bool) -> None:
        """Forgets a request that never reached the engine; free: its pages go back to the pool."""
        self._entries.pop(request_id, None)
        entry.receiver.cancel(request_id)
        if free:
            pages = list(entry.lease.page_ids)
            self._engine.post(lambda engine: (engine.free_pages(pages), self._publish(engine)))

    async def release(self, request_id: str) -> bool:
        entry = self._entries.get(request_id)
        if entry is None:
            if request_id in self._reserving:  # Reserve still allocating: free it when it lands
                self._reserving[request_id] = True
                return True
            return False
        if entry.first_token is None:  # an unclaimed lease
            return self._release_lease(request_id)
        await self._engine.call(lambda engine: self._abort(engine, request_id))
        return True

    def release_soon(self, request_id: str) -> None:
        """release() from a callback (e.g. when a Decode stream is cancelled)."""
        task = asyncio.get_running_loop().create_task(self.release(request_id))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _sweep_leases(self) -> None:
        while True:
            await asyncio.sleep(self.config.lease_sweep_interval_s)
            for lease in self._leases.expire():
                self.lease_expiries += 1
                entry = self._entries.get(lease.request_id)
                logger.warning("lease of request %s expired unclaimed; freeing %d pages", lease.request_id, len(lease.page_ids))
                if entry is not None and entry.lease.lease_id == lease.lease_id:
                    self._drop(lease.request_id, entry, free=True)
                else:
                    pages = list(lease.page_ids)
                    self._engine.post(lambda engine, pages=pages: engine.free_pages(pages))


def _build_engine(config: DecodeWorkerConfig) -> Any:
    from engine.llm_engine import LLMEngine

    return LLMEngine(config.engine_config())
