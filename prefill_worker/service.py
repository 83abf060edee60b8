"""The prefill worker's request handling, independent of gRPC.

prefill() queues a job; the engine thread takes queued jobs in arrival order up to `batch_tokens` prompt
tokens (fewer when that would take longer than `batch_target_ms`: batch_policy.py) and runs them in one
engine.prefill call (chunked inside the engine), writing KV straight into the decode pools (shm) or into
local pages (grpc); for models with linear attention the KDA state goes with them (straight into decode's
reserved state slot on shm; from a local slot, pushed, on grpc). The KV export (completion records / push)
then runs off the engine thread, so the next batch can start.

A job has one state (JobState) and one answer (the future prefill() returns):
  QUEUED -> RUNNING (the engine thread took it) -> COMPUTED (its result is back on the event loop) -> DONE,
  or CANCELLED from any of the first three (the caller went away, or cancel()): no record is written after.
Answer before record: on shm the KV is already in place when the forward ends, so the callback that brings
the result back answers the caller there and then (the first token leaves at once), and the job's hand-off
task writes the completion record (the checksum decode verifies before it admits the request) once the
caller's `reply_sent` says the reply is out. A Decode that arrives sooner waits for the record. Other
transports export first, then answer. cancel() drops a queued job, or stops a running one between two chunks
(the engine asks before each chunk), and returns once the job no longer touches its destination pages."""
from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import enum
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.cache.kv_events import KVEventLog
from engine.runtime.outputs import PrefillJob, PrefillResult, PrefixCacheStats
from engine.sampling_params import SamplingParams
from engine.runtime.sequence import TokenLogprob
from kvtransfer.checksum import INLINE_CHECKSUM_BYTES
from kvtransfer.destination import Destination, TransportKind
from kvtransfer.device_transport import DeviceWriter
from kvtransfer.grpc_transport import GrpcWriter
from kvtransfer.layout import KVLayout
from kvtransfer.shm_transport import ShmWriter
from kvtransfer.errors import KVTransferError, LeaseExpired, UnknownTransfer
from rpc.core_board import CoreBoard, PrefillCores
from rpc.engine_thread import EngineThread
from rpc.processes import child_start_method
from rpc.status import AlreadyExists, FailedPrecondition, InvalidArgument, Unavailable
from rpc.interceptors import token_metadata
from prefill_worker.batch_policy import PrefillCost, batch_token_limit
from prefill_worker.config import PrefillWorkerConfig
from prefill_worker.engine_api import PageCopies, PrefillEngine
from prefill_worker.kv_export import (
    finish_shm, prefill_pool_names, push_pages, rank_device_ids, stage_to_host, writes_in_place,
)
from prefill_worker.metrics import PrefillMetrics

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefillOutcome:
    first_token: int
    first_logprob: TokenLogprob | None
    num_prompt_tokens: int
    queue_ms: float
    prefill_ms: float
    transfer_ms: float
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # engine TokenLogprobs of prompt tokens 1 .. n-1 (prompt scoring)
    num_cached_tokens: int = 0  # prompt tokens the engine's prefix cache served


class JobState(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"  # on the engine thread
    COMPUTED = "computed"  # its result is back; the KV hand-off runs
    DONE = "done"
    CANCELLED = "cancelled"  # nothing more is written for it


@dataclass(frozen=True)
class _Computed:
    """What the engine thread hands back: the result and, for grpc, the page copies to push (and the
    state slot's rows of every rank, for linear attention)."""

    result: PrefillResult
    prefill_ms: float
    pages: PageCopies | None = None
    states: torch.Tensor | None = None


@dataclass(eq=False)
class _Job:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    destination: Destination
    answer: asyncio.Future[PrefillOutcome]  # what prefill() returns (set before a deferred completion record)
    reply_sent: asyncio.Event  # the caller's: its reply is out (or the call ended)
    state: JobState = JobState.QUEUED  # changed under the service's lock
    arrival: float = field(default_factory=time.perf_counter)
    started: float = 0.0
    local_pages: list[int] = field(default_factory=list)
    local_slot: int | None = None  # grpc, linear attention: this engine's state slot for the prompt
    over: asyncio.Event = field(default_factory=asyncio.Event)  # the job no longer touches its pages
    context: contextvars.Context = field(default_factory=contextvars.copy_context)  # the caller's (its log lines' request id)


@dataclass(frozen=True)
class PrefillLoadSnapshot:
    queued_requests: int
    queued_tokens: int
    tp_size: int
    requests_total: int
    free_state_slots: int = 0  # the prefill engine's own KDA state slots (0 for pure MLA or before start)
    total_state_slots: int = 0
    checkpoints: int = 0  # recurrent-state checkpoints the prefix cache holds (0 without one)
    checkpoint_slots: int = 0  # the prefix cache's checkpoint pool size (0 without one)


class PrefillService:
    def __init__(self, config: PrefillWorkerConfig, engine_factory: Callable[[], PrefillEngine] | None = None,
                 metrics: PrefillMetrics | None = None) -> None:
        self.config = config
        self.metrics = metrics if metrics is not None else PrefillMetrics()
        self.metrics.track(lambda: self.load, self._cache_stats)
        self._lock = threading.Lock()
        self._queue: collections.deque[_Job] = collections.deque()
        self._jobs: dict[str, _Job] = {}
        self._accepted = 0
        self._cost = PrefillCost()  # engine thread only
        factory = engine_factory or (lambda: _build_engine(config))
        self._engine: EngineThread[PrefillEngine] = EngineThread(factory, self._work, name="prefill-engine")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task[None]] = set()  # the jobs' hand-offs
        self.engine: PrefillEngine | None = None
        self._shm: ShmWriter | None = None
        self._grpc: GrpcWriter | None = None
        self._device: DeviceWriter | None = None
        self._device_ids: tuple[str, ...] = ()
        self._board = CoreBoard(config.core_board) if config.core_board else None
        self._cores: PrefillCores | None = None  # borrowing the decode workers' cores while they idle
        self._counted_borrowed = 0  # of its borrowed steps, those the metric has counted
        if self._board is not None:
            self._board.set_busy(config.core_board_slot, False)
            if config.borrow_cpus:
                self._cores = prefill_cores(self._board, config)

    def _cache_stats(self) -> PrefixCacheStats | None:
        """The engine's prefix cache counters (thread-safe: they are read under the engine's pool lock)."""
        return getattr(self.engine, "prefix_cache_stats", None)

    @property
    def kv_events(self) -> KVEventLog:
        """The engine's prefix cache events (engine/cache/kv_events.py; an empty log with the cache off)."""
        log = getattr(self.engine, "kv_events", None)
        if log is None:
            log = self.__dict__.setdefault("_no_kv_events", KVEventLog())
        return log

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if child_start_method(self.config.engine.device) == "fork":  # one thread yet: build here, TP followers fork
            self.engine = self._engine.start(build_here=True)
        else:
            self.engine = await asyncio.to_thread(self._engine.start)
        self.layout = KVLayout.from_cache_shape(self.engine.cache_shape)
        self._shm = ShmWriter(self.layout)
        self._grpc = GrpcWriter(self.layout, metadata=token_metadata(self.config.internal_token))
        self._device = DeviceWriter(self.layout, self.config.engine.device)
        self._device_ids = rank_device_ids(self.config.engine.device, self.config.engine.rank_gpus, self.config.tp_size)

    async def stop(self) -> None:
        with self._lock:
            queued, self._queue = list(self._queue), collections.deque()
            for job in queued:
                job.state = JobState.CANCELLED
        for job in queued:
            self.metrics.prompts.labels("error").inc()
            self._end(job, Unavailable("prefill worker shutting down"))
        await asyncio.to_thread(self._engine.stop)
        for writer in (self._shm, self._grpc, self._device):
            if writer is not None:
                writer.close()
        if self._board is not None:
            self._board.close()

    @property
    def load(self) -> PrefillLoadSnapshot:
        engine = self.engine
        slots = (getattr(engine, "num_free_state_slots", 0), getattr(engine, "num_state_slots", 0))
        stats = self._cache_stats()
        checkpoints = (stats.checkpoints, stats.checkpoint_slots) if stats is not None else (0, 0)
        with self._lock:
            return PrefillLoadSnapshot(len(self._queue), sum(len(job.prompt_ids) for job in self._queue),
                                       self.config.tp_size, self._accepted, *slots, *checkpoints)

    # --- requests -----------------------------------------------------------------------------------
    def _check(self, request_id: str, prompt_ids: list[int], params: SamplingParams, destination: Destination) -> None:
        if not request_id:
            raise InvalidArgument("request_id", "is empty")
        if request_id in self._jobs:
            raise AlreadyExists(f"request {request_id} is already being prefilled here")
        if destination.request_id != request_id:
            raise InvalidArgument("destination.request_id", f"{destination.request_id!r} is not {request_id!r}")
        if destination.transport not in (TransportKind.SHM, TransportKind.GRPC, TransportKind.DEVICE):
            raise FailedPrecondition(f"transport {destination.transport.name} is not supported by this prefill worker")
        if destination.num_tokens != len(prompt_ids):
            raise InvalidArgument("destination.num_tokens", f"{destination.num_tokens} != prompt length {len(prompt_ids)}")
        destination.check_against(self.layout, f"prefill of request {request_id}")
        if destination.transport == TransportKind.DEVICE and self.layout.has_state:
            raise FailedPrecondition("the device transport does not carry linear-attention (KDA) state yet; "
                                     "use shm or grpc")
        destination.check_lease()
        self._confirm(destination)
        self.engine.validate_prompt(prompt_ids)
        limit = self.config.spec_block_size  # decode checks it too, but only after the first token
        if params.block_size is not None and params.block_size > limit:
            raise InvalidArgument("block_size", f"{params.block_size} exceeds the server maximum {limit}")

    async def prefill(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                      destination: Destination, reply_sent: asyncio.Event | None = None) -> PrefillOutcome:
        """reply_sent: set by the caller once its reply has left (or will not); an shm completion record waits
        for it. None: the record follows as soon as this returns."""
        self._check(request_id, prompt_ids, params, destination)
        assert self._loop is not None
        job = _Job(request_id, list(prompt_ids), params, destination, self._loop.create_future(),
                   reply_sent or asyncio.Event())
        self._jobs[request_id] = job
        with self._lock:
            self._queue.append(job)
            self._accepted += 1
        self._engine.wake()
        try:
            outcome = await job.answer
        except asyncio.CancelledError:  # the caller went away: stop the job, no record
            self._cancel(job)
            raise
        if reply_sent is None:
            job.reply_sent.set()  # (the caller's continuation runs before the hand-off resumes)
        return outcome

    async def cancel(self, request_id: str) -> bool:
        """True: dropped before it ran. False: it had started (this waited until it stopped writing) or
        is unknown. Either way the destination pages are not touched after this returns."""
        job = self._jobs.get(request_id)
        if job is None:
            return False
        dropped = self._cancel(job)
        await job.over.wait()
        return dropped

    def _cancel(self, job: _Job) -> bool:
        """Marks the job CANCELLED (a running one stops at its next chunk; a computed one writes no record);
        True when it was still queued (then it is over now)."""
        with self._lock:
            queued = job.state is JobState.QUEUED
            if queued:
                self._queue.remove(job)
            if job.state is not JobState.DONE:
                job.state = JobState.CANCELLED
        if queued:
            self.metrics.prompts.labels("cancelled").inc()
            self._end(job, asyncio.CancelledError())
        return queued

    # --- event loop: the engine's result, the answer and the KV hand-off ---------------------------------
    def _computed(self, job: _Job, computed: _Computed | BaseException) -> None:
        """The engine thread's result (or failure), on the event loop. An in-place shm prefill is answered here
        and now (the caller resumes in the next loop pass); the hand-off task then writes the KV's record."""
        if isinstance(computed, BaseException) or job.state is JobState.CANCELLED:
            self.metrics.prompts.labels("error" if isinstance(computed, Exception) else "cancelled").inc()
            self._end(job, computed if isinstance(computed, BaseException) else asyncio.CancelledError())
            return
        job.state = JobState.COMPUTED
        if self._answers_early(job, computed):
            _resolve(job.answer, self._outcome(job, computed, 0.0))
        task = asyncio.get_running_loop().create_task(self._hand_off(job, computed), context=job.context)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _hand_off(self, job: _Job, computed: _Computed) -> None:
        """The KV export: after the reply for an early-answered shm prefill (skipped if the job was cancelled
        meanwhile), else before the answer. Every outcome goes to job.answer (this task never fails)."""
        early = job.answer.done()
        try:
            if early:
                await job.reply_sent.wait()
                if job.state is JobState.CANCELLED:  # ended before the reply was out: no record (lease released)
                    raise asyncio.CancelledError()
            started = time.perf_counter()
            num_bytes = await (self._export_after_reply(job, computed) if early else self._export(job, computed))
            transfer_s = time.perf_counter() - started
            logger.info("prefilled %d tokens: queue %.1f ms, prefill %.1f ms, %s handoff of %d bytes in %.1f ms",
                        len(job.prompt_ids), (job.started - job.arrival) * 1000, computed.prefill_ms,
                        job.destination.transport.name.lower(), num_bytes, transfer_s * 1000)
            self.metrics.prefilled(job.started - job.arrival, computed.prefill_ms / 1000,
                                   job.destination.transport.name.lower(), num_bytes, transfer_s)
            self._end(job, self._outcome(job, computed, transfer_s * 1000))
        except asyncio.CancelledError:
            self.metrics.prompts.labels("cancelled").inc()
            self._end(job, asyncio.CancelledError())
        except Exception as error:  # noqa: BLE001 - handed to the caller (or, once answered, to decode's admission)
            self.metrics.prompts.labels("error").inc()
            if early:  # a deferred record failed: the writer marked it FAILED, decode refuses the KV
                logger.warning("completion record of %s failed after its response: %s", job.request_id, error)
            self._end(job, error)

    def _end(self, job: _Job, outcome: PrefillOutcome | BaseException) -> None:
        """The job is over: its answer (unless given already), and it no longer touches its pages."""
        with self._lock:
            if job.state is not JobState.CANCELLED:
                job.state = JobState.DONE
        _resolve(job.answer, outcome)
        if self._jobs.get(job.request_id) is job:
            del self._jobs[job.request_id]
        job.over.set()

    @staticmethod
    def _answers_early(job: _Job, computed: _Computed) -> bool:
        """shm written in place: the caller is answered before the completion record (see the module doc)."""
        return computed.pages is None and job.destination.transport == TransportKind.SHM

    @staticmethod
    def _outcome(job: _Job, computed: _Computed, transfer_ms: float) -> PrefillOutcome:
        result = computed.result
        return PrefillOutcome(result.first_token, result.first_logprobs, result.num_prompt_tokens,
                              (job.started - job.arrival) * 1000, computed.prefill_ms, transfer_ms,
                              result.prompt_logprobs, result.num_cached_tokens)

    async def _export_after_reply(self, job: _Job, computed: _Computed) -> int:
        """The deferred shm record; none (0 bytes) once the lease has ended - released after the reply (a
        request that ended at its first token) or expired: nobody will admit this KV."""
        try:
            self._confirm(job.destination)  # (checked first: the writer would log an abort)
            return await self._export(job, computed)
        except (UnknownTransfer, LeaseExpired) as error:
            logger.info("no completion record for %s: its lease ended after the reply (%s)", job.request_id, error)
            return 0

    async def _export(self, job: _Job, computed: _Computed) -> int:
        """The KV handoff after the forward; returns the bytes it covered."""
        transport = job.destination.transport
        if computed.pages is None and transport == TransportKind.SHM and self._small(job.destination):
            return finish_shm(self._shm, job.destination, self.config.tp_size)  # microseconds: no thread hop
        if computed.pages is None:  # written in place (shm, or device on the pool's own device)
            writer = self._shm if transport == TransportKind.SHM else self._device
            return await asyncio.to_thread(finish_shm, writer, job.destination, self.config.tp_size)
        if transport == TransportKind.DEVICE:  # another device of the node: a peer copy
            return await asyncio.to_thread(push_pages, self._device, job.destination, *computed.pages)
        target, draft = stage_to_host(computed.pages)
        return await asyncio.to_thread(push_pages, self._grpc, job.destination, target, draft, computed.states)

    def _small(self, destination: Destination) -> bool:
        """Whether an shm handoff checksums few enough bytes to finish on the event loop (microseconds)
        rather than pay a thread hop on the first token's path; larger ones go to a thread."""
        pages = len(destination.page_ids) * destination.num_ranks
        return pages * self.layout.bytes_per_page <= INLINE_CHECKSUM_BYTES

    # --- engine thread --------------------------------------------------------------------------------
    def _take_batch(self) -> list[_Job]:
        batch: list[_Job] = []
        tokens = 0
        limit = batch_token_limit(self.config.batch_tokens, self.config.batch_target_ms, self._cost.ms_per_token)
        with self._lock:
            while self._queue and (not batch or tokens + len(self._queue[0].prompt_ids) <= limit):
                job = self._queue.popleft()
                job.state, job.started = JobState.RUNNING, time.perf_counter()
                batch.append(job)
                tokens += len(job.prompt_ids)
        return batch

    def _work(self, engine: PrefillEngine) -> bool:
        batch = self._take_batch()
        if not batch:
            return False
        runnable, engine_jobs = [], []
        for job in batch:
            try:
                job.destination.check_lease()
                self._confirm(job.destination)  # again: the lease may have been released while queued
                if self._in_place(job.destination):  # pages and (linear attention) state slot: decode's
                    pages, pools = list(job.destination.page_ids), prefill_pool_names(job.destination, engine.config.tp_size)
                    slot = job.destination.state_slot
                else:  # local pages for what decode lacks (its cached pages are not sent)
                    job.local_pages, job.local_slot = engine.allocate_reservation(
                        len(job.prompt_ids) - job.destination.cached_tokens)
                    pages, pools, slot = job.local_pages, None, job.local_slot
            except Exception as error:  # noqa: BLE001 - reported to the job's caller
                self._fail(job, error)
                continue
            runnable.append(job)
            engine_jobs.append(PrefillJob(job.request_id, job.prompt_ids, job.params, pages, pools, slot,
                                          job.destination.cached_tokens))
        if not runnable:
            return True
        started = time.perf_counter()
        by_id = {job.request_id: job for job in runnable}
        try:
            lending = {} if self._cores is None else {"before_step": self._cores.before_step}
            results: list[PrefillResult | None] = []
            with self._own_cores():
                try:
                    results = engine.prefill(engine_jobs,
                                             should_stop=lambda request_id: self._should_stop(by_id[request_id]),
                                             **lending)
                finally:
                    if self._cores is not None:
                        self._cores.done(handed_off=any(result is not None for result in results))
                        self.metrics.borrowed_steps.inc(self._cores.borrowed_steps - self._counted_borrowed)
                        self._counted_borrowed = self._cores.borrowed_steps
        except Exception as error:  # noqa: BLE001
            logger.exception("prefill of %d prompts failed", len(runnable))
            for job in runnable:
                self._free_local(engine, job)
                self._fail(job, error)
            return True
        prefill_ms = (time.perf_counter() - started) * 1000
        self._cost.observe(prefill_ms, sum(len(job.prompt_ids) for job in runnable))
        for job, result in zip(runnable, results):
            if result is None:  # cancelled (or its lease ran out) between chunks: nothing more was written
                cancelled = job.state is JobState.CANCELLED
                logger.info("prefill of %s stopped between chunks (%s)", job.request_id,
                            "cancelled" if cancelled else "lease ended")
                self._free_local(engine, job)
                self._fail(job, asyncio.CancelledError() if cancelled else
                           LeaseExpired(f"the lease of request {job.request_id} ended during its prefill"))
                continue
            pages = states = None
            if job.local_pages:
                pages = engine.read_pages(job.local_pages)
                states = engine.read_state(job.local_slot) if job.local_slot is not None else None
                self._free_local(engine, job)
            assert self._loop is not None
            self._loop.call_soon_threadsafe(self._computed, job, _Computed(result, prefill_ms, pages, states))
        return True

    def _own_cores(self) -> contextlib.AbstractContextManager[object]:
        """Around a forward: with core lending, this worker is marked busy and its cores handed back by the
        decode worker first (rpc/core_board.py)."""
        if self._board is None:
            return contextlib.nullcontext()
        return self._board.prefilling(self.config.core_board_slot)

    def _confirm(self, destination: Destination) -> None:
        """shm writes land straight in the decode pool: only into pages the decode worker reserved for
        this request under this lease (its completion slot says so), checked before the first byte.
        grpc pushes are checked by the decode worker itself, chunk by chunk, before it writes."""
        if destination.transport == TransportKind.SHM:
            assert self._shm is not None
            self._shm.confirm(destination)
        elif destination.transport == TransportKind.DEVICE:
            assert self._device is not None
            self._device.confirm(destination)

    def _in_place(self, destination: Destination) -> bool:
        """The engine runs its forward straight into the destination pages: shm always; device when every
        prefill rank shares its device with the decode pool it writes (else compute locally, then copy)."""
        if destination.transport == TransportKind.SHM:
            return True
        if destination.transport != TransportKind.DEVICE:
            return False
        assert self._device is not None
        pools = prefill_pool_names(destination, self.config.tp_size)
        return writes_in_place([self._device.pool(name).device_id for name in pools], self._device_ids)

    def _should_stop(self, job: _Job) -> bool:
        """Asked by the engine thread between chunks: the job was cancelled, or the lease ran out or is no
        longer reserved for this request (released by the decode worker)."""
        if job.state is JobState.CANCELLED:
            return True
        try:
            job.destination.check_lease()
            self._confirm(job.destination)
        except KVTransferError:
            return True
        return False

    @staticmethod
    def _free_local(engine: PrefillEngine, job: _Job) -> None:
        if job.local_pages:
            engine.free_reservation(job.local_pages, job.local_slot)
            job.local_pages, job.local_slot = [], None

    def _fail(self, job: _Job, error: BaseException) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._computed, job, error)


def _resolve(future: asyncio.Future[PrefillOutcome], value: PrefillOutcome | BaseException) -> None:
    if future.done():
        return
    if isinstance(value, asyncio.CancelledError):
        future.cancel()
    elif isinstance(value, BaseException):
        future.set_exception(value)
    else:
        future.set_result(value)


def prefill_cores(board: CoreBoard, config: PrefillWorkerConfig) -> PrefillCores:
    """Core lending the other way: this worker's own cores are the mask it started with (`--cpus`), its own thread
    count the engine's; the decode workers' cores widen both while none of them has requests to step."""
    own = frozenset(os.sched_getaffinity(0))
    cores = PrefillCores(board, config.core_board_slot, own, frozenset(config.borrow_cpus) - own,
                         config.engine.num_threads or len(own), torch.set_num_threads,
                         extra_threads=config.borrow_threads)
    logger.info("core lending: %d own core(s), %d more while decode is idle (%d thread(s) then, steps of <= %d "
                "tokens)", len(own), len(cores.wide - own), cores.wide_threads, config.engine.max_batched_tokens)
    return cores


def _build_engine(config: PrefillWorkerConfig) -> PrefillEngine:
    from engine.runtime.llm_engine import LLMEngine

    return LLMEngine(config.engine_config())
