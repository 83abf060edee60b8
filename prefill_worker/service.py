"""The prefill worker's request handling, independent of gRPC.

prefill() queues a job; the engine thread takes queued jobs in arrival order up to `batch_tokens` prompt
tokens (fewer when that would take longer than `batch_target_ms`: batch_policy.py) and runs them in one
engine.prefill call (chunked inside the engine), writing KV straight into the decode pools (shm) or into
local pages (grpc); for models with linear attention the KDA state goes with them (straight into decode's
reserved state slot on shm; from a local slot, pushed, on grpc). The KV export (completion records / push)
then runs off the engine thread, so the next batch can start. On shm the KV is already in place when the
forward ends, so the RPC is answered first and the completion record (the checksum decode verifies before
it admits the request) is written once the reply is out (the caller's `reply_sent`): on the event loop it
would otherwise delay sending the first token. A Decode that arrives sooner waits for the record.
cancel() drops a queued job, or stops a running one between two chunks (the engine asks before each
chunk) and waits until it no longer touches its destination pages (a cancelled job writes no record)."""
from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.engine_types import PrefillJob
from engine.sampling_params import SamplingParams
from kvtransfer.checksum import INLINE_CHECKSUM_BYTES
from kvtransfer.destination import Destination, TransportKind
from kvtransfer.device_transport import DeviceWriter
from kvtransfer.grpc_transport import GrpcWriter
from kvtransfer.layout import KVLayout
from kvtransfer.shm_transport import ShmWriter
from kvtransfer.errors import KVTransferError, LeaseExpired, UnknownTransfer
from rpc.engine_thread import EngineThread
from rpc.processes import child_start_method
from rpc.status import AlreadyExists, FailedPrecondition, InvalidArgument, Unavailable
from rpc.interceptors import token_metadata
from prefill_worker.batch_policy import PrefillCost, batch_token_limit
from prefill_worker.config import PrefillWorkerConfig
from prefill_worker.kv_export import (
    finish_shm, prefill_pool_names, push_pages, rank_device_ids, stage_to_host, writes_in_place,
)
from prefill_worker.metrics import PrefillMetrics

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefillOutcome:
    first_token: int
    first_logprob: Any  # engine TokenLogprob or None
    num_prompt_tokens: int
    queue_ms: float
    prefill_ms: float
    transfer_ms: float


@dataclass
class _Job:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    destination: Destination
    future: asyncio.Future[Any]  # the engine thread's _Computed (or error)
    answer: asyncio.Future[PrefillOutcome]  # what the RPC returns (set before a deferred completion record)
    arrival: float = field(default_factory=time.perf_counter)
    state: str = "queued"  # queued -> running -> done | dropped
    started: float = 0.0
    local_pages: list[int] = field(default_factory=list)
    local_slot: int | None = None  # grpc, linear attention: this engine's state slot for the prompt
    finished: asyncio.Event = field(default_factory=asyncio.Event)
    answered: asyncio.Event = field(default_factory=asyncio.Event)  # the reply is out (or the call ended)
    cancelled: bool = False
    task: asyncio.Task[Any] | None = None


@dataclass(frozen=True)
class _Computed:
    """What the engine thread hands back: the result and, for grpc, the page copies to push (and the
    state slot's rows of every rank, for linear attention)."""

    result: Any
    prefill_ms: float
    pages: tuple[Any, Any] | None = None
    states: Any = None


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
    def __init__(self, config: PrefillWorkerConfig, engine_factory: Callable[[], Any] | None = None,
                 metrics: PrefillMetrics | None = None) -> None:
        self.config = config
        self.metrics = metrics if metrics is not None else PrefillMetrics()
        self.metrics.track(lambda: self.load)
        self._lock = threading.Lock()
        self._queue: collections.deque[_Job] = collections.deque()
        self._jobs: dict[str, _Job] = {}
        self._accepted = 0
        self._cost = PrefillCost()  # engine thread only
        factory = engine_factory or (lambda: _build_engine(config))
        self._engine: EngineThread[Any] = EngineThread(factory, self._work, name="prefill-engine")
        self._loop: asyncio.AbstractEventLoop | None = None
        self.engine: Any = None
        self._shm: ShmWriter | None = None
        self._grpc: GrpcWriter | None = None
        self._device: DeviceWriter | None = None
        self._device_ids: tuple[str, ...] = ()

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
            job.state = "dropped"
            _resolve(job.future, Unavailable("prefill worker shutting down"))
        await asyncio.to_thread(self._engine.stop)
        for writer in (self._shm, self._grpc, self._device):
            if writer is not None:
                writer.close()

    @property
    def load(self) -> PrefillLoadSnapshot:
        engine = self.engine
        slots = (getattr(engine, "num_free_state_slots", 0), getattr(engine, "num_state_slots", 0))
        with self._lock:
            return PrefillLoadSnapshot(len(self._queue), sum(len(job.prompt_ids) for job in self._queue),
                                       self.config.tp_size, self._accepted, *slots)

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
        """reply_sent: set by the caller once its reply has left (gRPC: the call's done callback, which also
        fires when the call ends any other way); an shm completion record waits for it. None: the record
        follows as soon as this returns."""
        self._check(request_id, prompt_ids, params, destination)
        assert self._loop is not None
        job = _Job(request_id, list(prompt_ids), params, destination, self._loop.create_future(),
                   self._loop.create_future(), answered=reply_sent or asyncio.Event())
        self._jobs[request_id] = job
        with self._lock:
            self._queue.append(job)
            self._accepted += 1
        self._engine.wake()
        job.task = self._loop.create_task(self._complete(job))
        try:  # (not shielded: a cancelled RPC cancels only its answer; the job goes on in _complete)
            outcome = await job.answer
        except BaseException as error:
            if isinstance(error, asyncio.CancelledError):
                job.cancelled = True
                self._drop_if_queued(job)
            job.answered.set()  # no reply to wait for
            raise
        if reply_sent is None:
            job.answered.set()  # (the caller's continuation runs before the job resumes)
        return outcome

    async def _complete(self, job: _Job) -> None:
        """Waits for the engine, answers the RPC and exports the KV (skipped when the request was cancelled
        meanwhile); every outcome, error included, goes to job.answer (this task itself never fails)."""
        try:
            computed = await job.future
            if job.cancelled:
                raise asyncio.CancelledError()
            if self._answers_early(job, computed):  # answered by _computed already: the KV is in place
                await job.answered.wait()
                if job.cancelled:  # call or Cancel ended it before the reply was out: no record (lease released)
                    raise asyncio.CancelledError()
            started = time.perf_counter()
            num_bytes = await self._export_after_reply(job, computed) if _answered(job) else \
                await self._export(job, computed)
            transfer_s = time.perf_counter() - started
            logger.info("prefilled %d tokens: queue %.1f ms, prefill %.1f ms, %s handoff of %d bytes in %.1f ms",
                        len(job.prompt_ids), (job.started - job.arrival) * 1000, computed.prefill_ms,
                        job.destination.transport.name.lower(), num_bytes, transfer_s * 1000)
            self.metrics.prefilled(job.started - job.arrival, computed.prefill_ms / 1000,
                                   job.destination.transport.name.lower(), num_bytes, transfer_s)
            _resolve(job.answer, self._outcome(job, computed, transfer_s * 1000))
        except asyncio.CancelledError:
            self.metrics.prompts.labels("cancelled").inc()
            _resolve(job.answer, asyncio.CancelledError())
        except Exception as error:  # noqa: BLE001 - handed to the RPC (or, once answered, to decode's admission)
            self.metrics.prompts.labels("error").inc()
            if _answered(job):  # a deferred record failed: the writer marked it FAILED, decode refuses the KV
                logger.warning("completion record of %s failed after its response: %s", job.request_id, error)
            _resolve(job.answer, error)
        finally:
            self._jobs.pop(job.request_id, None)
            job.finished.set()

    def _computed(self, job: _Job, computed: _Computed) -> None:
        """The engine's result, on the event loop: an in-place shm prefill is answered here and now, so the
        RPC's task wakes before _complete's (one loop pass from the engine thread to the reply); _complete
        then writes the record once the reply is out."""
        if self._answers_early(job, computed) and not job.cancelled:
            _resolve(job.answer, self._outcome(job, computed, 0.0))
        _resolve(job.future, computed)

    @staticmethod
    def _answers_early(job: _Job, computed: _Computed) -> bool:
        """shm written in place: the RPC is answered before the completion record (see the module doc)."""
        return computed.pages is None and job.destination.transport == TransportKind.SHM

    @staticmethod
    def _outcome(job: _Job, computed: _Computed, transfer_ms: float) -> PrefillOutcome:
        result = computed.result
        return PrefillOutcome(result.first_token, result.first_logprobs, result.num_prompt_tokens,
                              (job.started - job.arrival) * 1000, computed.prefill_ms, transfer_ms)

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

    def _drop_if_queued(self, job: _Job) -> bool:
        with self._lock:
            if job.state != "queued":
                return False
            job.state = "dropped"
            self._queue.remove(job)
        job.future.cancel()
        return True

    async def cancel(self, request_id: str) -> bool:
        """True: dropped before it ran. False: it had started (this waited until it stopped writing) or
        is unknown. Either way the destination pages are not touched after this returns."""
        job = self._jobs.get(request_id)
        if job is None:
            return False
        job.cancelled = True
        dropped = self._drop_if_queued(job)
        await job.finished.wait()
        return dropped

    # --- engine thread --------------------------------------------------------------------------------
    def _take_batch(self) -> list[_Job]:
        batch: list[_Job] = []
        tokens = 0
        limit = batch_token_limit(self.config.batch_tokens, self.config.batch_target_ms, self._cost.ms_per_token)
        with self._lock:
            while self._queue and (not batch or tokens + len(self._queue[0].prompt_ids) <= limit):
                job = self._queue.popleft()
                job.state, job.started = "running", time.perf_counter()
                batch.append(job)
                tokens += len(job.prompt_ids)
        return batch

    def _work(self, engine: Any) -> bool:
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
                else:
                    job.local_pages, job.local_slot = engine.allocate_reservation(len(job.prompt_ids))
                    pages, pools, slot = job.local_pages, None, job.local_slot
            except Exception as error:  # noqa: BLE001 - reported on the job's RPC
                self._fail(job, error)
                continue
            runnable.append(job)
            engine_jobs.append(PrefillJob(job.request_id, job.prompt_ids, job.params, pages, pools, slot))
        if not runnable:
            return True
        started = time.perf_counter()
        by_id = {job.request_id: job for job in runnable}
        try:
            results = engine.prefill(engine_jobs, should_stop=lambda request_id: self._should_stop(by_id[request_id]))
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
                logger.info("prefill of %s stopped between chunks (%s)", job.request_id,
                            "cancelled" if job.cancelled else "lease ended")
                self._free_local(engine, job)
                self._fail(job, asyncio.CancelledError() if job.cancelled else
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
        """Asked by the engine thread between chunks: the RPC was cancelled, or the lease ran out or is no
        longer reserved for this request (released by the decode worker)."""
        if job.cancelled:
            return True
        try:
            job.destination.check_lease()
            self._confirm(job.destination)
        except KVTransferError:
            return True
        return False

    @staticmethod
    def _free_local(engine: Any, job: _Job) -> None:
        if job.local_pages:
            engine.free_reservation(job.local_pages, job.local_slot)
            job.local_pages, job.local_slot = [], None

    def _fail(self, job: _Job, error: BaseException) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(_resolve, job.future, error)


def _answered(job: _Job) -> bool:
    """The RPC has its answer (an RPC cancelled meanwhile cancels its answer: not answered)."""
    return job.answer.done() and not job.answer.cancelled()


def _resolve(future: asyncio.Future[Any], value: Any) -> None:
    if future.done():
        return
    if isinstance(value, asyncio.CancelledError):
        future.cancel()
    elif isinstance(value, BaseException):
        future.set_exception(value)
    else:
        future.set_result(value)


def _build_engine(config: PrefillWorkerConfig) -> Any:
    from engine.llm_engine import LLMEngine

    return LLMEngine(config.engine_config())
