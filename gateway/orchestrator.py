"""One request's path through the workers: Reserve (decode) -> Prefill -> Decode stream, as a task that
produces events (tokens with their text, then a finish or an error) for the servicer to send.

Cleanup on every exit (finish, stop string, client cancel, Abort, error) keeps one rule: the pages of an
unclaimed lease are released only once the prefill worker has confirmed it no longer writes them
(its Prefill returned, or Cancel returned: a running prefill stops between two chunks); cleanup waits
for that as long as the lease lasts; if the confirmation cannot be had, the lease is left to expire on
the decode worker, which frees it then."""
from __future__ import annotations

import asyncio
import enum
import logging
import time
import uuid
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Protocol

import grpc

from gateway.detokenizer import IncrementalDetokenizer
from gateway.decode_stream import DecodeCall
from gateway.held_observer import HeldObserver
from gateway.kv_index import PromptKeys
from gateway.requests import GenerateJob
from gateway.route_note import RouteNote, decode_cached_tokens
from gateway.stop_strings import StopStringMatcher
from gateway.tokenizer import TextTokenizer
from gateway.worker_clients import DecodeWorker, PrefillWorker
from gateway.workers import WorkerPool, remaining
from rpc.convert import sampling_to_proto
from rpc.internal.v1 import kv_pb2, worker_pb2
from rpc.logging_setup import bind_request_id, request_metadata
from rpc.status import Unavailable, status_of
from rpc.v1 import logprobs_pb2

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TokensEvent:
    token_ids: list[int]
    text: str
    logprobs: list[logprobs_pb2.TokenLogprob] = field(default_factory=list)  # one per token when asked
    # the first event: prompt tokens 1 .. n-1 when asked
    prompt_logprobs: list[logprobs_pb2.TokenLogprob] = field(default_factory=list)


@dataclass(frozen=True)
class FinishEvent:
    reason: str  # "stop" | "length" | "abort"
    prompt_tokens: int
    completion_tokens: int
    ttft_ms: float
    decode_steps: int
    decode_tokens: int
    stop: str = ""
    cached_tokens: int = 0  # prompt tokens not computed: the larger of the prefill and the decode worker's cache hits


@dataclass(frozen=True)
class ErrorEvent:
    """The request failed: the full status (code, message, google.rpc details) the RPC ends with."""

    status: grpc.Status


class RunObserver(Protocol):
    """What a run reports as it goes (gateway.metrics.GatewayMetrics); times in seconds."""

    def admitted(self, queue_s: float, prompt_tokens: int, spare: bool = False) -> None: ...  # spare: took a standing lease
    def prefilled(self, prefill_s: float) -> None: ...
    def decode_started(self, setup_s: float) -> None: ...
    def first_token(self, ttft_s: float) -> None: ...
    def tokens(self, count: int, gap_s: float | None) -> None: ...
    def finished(self, e2e_s: float, decode_steps: int, decode_tokens: int) -> None: ...
    # role "decode" / "prefill": prompt tokens the KV index expected the chosen worker to hold, and what it reported
    def cache_routed(self, role: str, expected: int, actual: int | None) -> None: ...


class PrefillState(enum.Enum):
    """Where a run's prefill stands, for cleanup: a call INFLIGHT or FAILED may have written (or still write)
    into the decode reservation, so cleanup asks the prefill worker to stop first."""

    NONE = "none"
    INFLIGHT = "inflight"
    OK = "ok"
    FAILED = "failed"


class DecodeState(enum.Enum):
    """Where a run's decode side stands, for cleanup: RESERVED or STREAMING still hold pages to release."""

    NONE = "none"
    RESERVED = "reserved"
    STREAMING = "streaming"
    FINISHED = "finished"


def usable_cached_tokens(destination: kv_pb2.KVDestination) -> int:
    """Prompt tokens a prefill on the decode worker itself starts after: its cached pages, or (linear attention:
    the destination names a state slot) only up to its state checkpoint."""
    return destination.checkpoint_tokens if destination.HasField("state_slot") else destination.cached_tokens


def prefills_locally(destination: kv_pb2.KVDestination, job: GenerateJob, threshold: int) -> bool:
    """Conditional disaggregation: the part of the prompt its decode worker lacks is shorter than the threshold
    (0: never). A request asking for prompt logprobs always goes to a prefill worker (which scores prompts)."""
    if threshold <= 0 or job.params.prompt_logprobs is not None:
        return False
    return len(job.prompt_ids) - usable_cached_tokens(destination) < threshold


class RequestRun:
    """Runs one GenerateJob. events: an asyncio.Queue the servicer drains until a Finish/Error event.
    disagg_threshold_tokens: conditional disaggregation (prefills_locally; 0: always a prefill worker)."""

    def __init__(self, job: GenerateJob, pool: WorkerPool, tokenizer: TextTokenizer | None,
                 arrival: float, deadline: float | None, cleanup_timeout_s: float,
                 observer: RunObserver | None = None, disagg_threshold_tokens: int = 0,
                 after: asyncio.Event | None = None) -> None:
        self.job = job
        # after: the run starts once this is set (choices 1..n-1 of an n > 1 request wait until choice 0 decodes, so
        # they find its prompt in the prefix caches - prefill's and, on the same decode worker, decode's, which
        # publishes a claimed prompt's pages at once - instead of computing it beside it)
        self._after = after
        self.decoding = asyncio.Event()  # set at this run's first decode update or its end, whichever comes first
        # Two ids, each with one name from here to the workers: trace_id is the client's request id (the
        # x-request-id every service's log lines carry: `trace_id` on the worker streams); request_id is the
        # id the workers know this run by (`request_id` in every worker message), unique per run so that a
        # client may reuse its id as soon as the Complete is sent while this run's cleanup still talks to the
        # workers, or a standing lease's id when the run takes one.
        self.trace_id = job.request_id
        self.request_id = f"{job.request_id}.{uuid.uuid4().hex[:12]}"
        self._metadata = request_metadata(self.trace_id) + pool.metadata  # x-request-id (+ internal token)
        # what the run reports before its first token is out is recorded after (_release_observer)
        self._observer: RunObserver | HeldObserver | None = HeldObserver(observer) if observer is not None else None
        self._last_token_at: float | None = None
        self.admitted = False  # a decode worker reserved its pages
        self._pool = pool
        self._arrival = arrival
        self._deadline = deadline
        self._cleanup_timeout = cleanup_timeout_s
        self._disagg_threshold = disagg_threshold_tokens  # GatewayConfig.disagg_threshold_tokens (0: always prefill)
        self.events: asyncio.Queue[TokensEvent | FinishEvent | ErrorEvent] = asyncio.Queue()
        self._detok = IncrementalDetokenizer(tokenizer, job.prompt_ids, job.skip_special_tokens) if tokenizer else None
        self._stops = StopStringMatcher(job.stop)
        self._completion_tokens = 0
        self._generated: list[int] = []  # every token streamed to the client (a migration prefills them again)
        self._migrations = 0
        self._tasks: set[asyncio.Future[None]] = set()  # background releases of lost decode workers
        self._decode_steps = 0
        self._decode_tokens = 0
        self._ttft_ms = 0.0
        self._cached_tokens = 0  # prompt tokens not computed (FinishEvent.cached_tokens)
        self.route = RouteNote()  # where it was routed, the overlap expected there and the one reported
        # where the request is, for cleanup
        self._decode: DecodeWorker | None = None
        self._prefill: PrefillWorker | None = None
        self._prefill_state = PrefillState.NONE
        self._decode_state = DecodeState.NONE
        self._prefill_call: asyncio.Future[worker_pb2.PrefillResponse] | None = None
        self._decode_call: DecodeCall | None = None
        self._cancelling = False
        self._lease_deadline = 0.0  # time.time() when the decode lease lapses (its pages freed there)
        self.finished = False  # the final event is queued (cleanup may still be running)
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._produce())

    def cancel(self) -> None:
        """Client went away or Abort: stop the work (once), clean up, end with an abort FinishEvent.
        A run whose final event is queued is left alone: it is only cleaning up."""
        if self.task is not None and not self.task.done() and not self._cancelling and not self.finished:
            self._cancelling = True
            self.task.cancel()

    # --- the request path ---------------------------------------------------------------------------
    async def _produce(self) -> None:
        bind_request_id(self.trace_id)  # this task's log lines name the request
        try:
            if self._after is not None and not self._after.is_set():
                await asyncio.wait_for(self._after.wait(), remaining(self._deadline))
            await self._run()
        except asyncio.CancelledError:
            self._finish("abort")
        except Exception as error:  # noqa: BLE001 - every failure becomes an ErrorEvent
            status = status_of(error)
            if status.code == grpc.StatusCode.INTERNAL:
                logger.exception("request %s failed", self.trace_id)
            self.finished = True
            self._observe_end()
            self.events.put_nowait(ErrorEvent(status))
        finally:
            self.decoding.set()
            try:
                await asyncio.wait_for(self._cleanup(), self._cleanup_budget())
            except (asyncio.TimeoutError, asyncio.CancelledError, grpc.aio.AioRpcError) as error:
                logger.warning("cleanup of request %s incomplete: %r", self.trace_id, error)

    async def _run(self) -> None:
        job, params = self.job, self.job.params
        if not self._pool.polled.is_set():
            await asyncio.wait_for(self._pool.polled.wait(), remaining(self._deadline))
        keys = PromptKeys(job.prompt_ids)
        # (a run gated on another's prompt - a choice of an n > 1 request - reserves, so the decode worker maps it)
        standing = self._pool.take_standing(len(job.prompt_ids), keys) if self._after is None else None
        if standing is not None:  # a spare reservation: no Reserve round trip; run under its id on the workers
            self._decode, destination = standing
            self.request_id = destination.request_id
        else:
            self._decode, destination = await self._pool.reserve(
                self.request_id, len(job.prompt_ids), params.max_new_tokens, self._deadline, trace_id=self.trace_id,
                prompt=keys)
        self._note_decode(keys, destination)
        self._decode_state = DecodeState.RESERVED
        self._lease_deadline = destination.lease_deadline_unix_ms / 1000
        self.admitted = True
        reserved = time.perf_counter()
        if self._observer is not None:
            self._observer.admitted(reserved - self._arrival, len(job.prompt_ids), spare=standing is not None)
        sampling = sampling_to_proto(params)
        if prefills_locally(destination, job, self._disagg_threshold):
            # no prefill hop: the decode worker prefills the rest itself; its first update brings the first token
            self._cached_tokens = usable_cached_tokens(destination)
            logger.info("prefill on the decode worker: %d of %d prompt tokens cached there", self._cached_tokens,
                        len(job.prompt_ids))
            self._release_observer()
            if standing is not None:
                self._pool.refill_standing()
            await self._decode_legs(worker_pb2.DecodeRequest(
                request_id=self.request_id, lease_id=destination.lease_id, token_ids=job.prompt_ids,
                sampling=sampling, stream_interval=job.stream_interval, prefill_locally=True), reserved)
            return
        response = await self._run_prefill(destination, sampling, keys=keys)
        prefilled = time.perf_counter()
        self._ttft_ms = (prefilled - self._arrival) * 1000
        if self._observer is not None:
            self._observer.prefilled(prefilled - reserved)
        first = response.first_token
        # what was not computed: the larger of the prefill worker's hit and the decode worker's (not sent)
        self._cached_tokens = max(response.num_cached_tokens, destination.cached_tokens)
        logprobs = [response.first_logprob] if response.HasField("first_logprob") else []
        if self._emit([first], logprobs, list(response.prompt_logprobs)):
            return
        if job.ends_on(first) or params.max_new_tokens == 1:
            self._finish("stop" if job.ends_on(first) else "length")
            return
        await asyncio.sleep(0)  # the servicer sends the first token on before the Decode call is set up
        self._release_observer()  # (metrics held until the first token was handed on)
        if standing is not None:  # refill the spare now that it competes with neither prefill nor first token
            self._pool.refill_standing()
        request = worker_pb2.DecodeRequest(request_id=self.request_id, lease_id=destination.lease_id,
                                           token_ids=job.prompt_ids, first_token=first, sampling=sampling,
                                           stream_interval=job.stream_interval)
        await self._decode_legs(request, prefilled)

    async def _decode_legs(self, request: worker_pb2.DecodeRequest | None, prefilled: float) -> None:
        """The Decode, migrated to another decode worker (prefill there) each time its worker dies or hangs."""
        while request is not None:
            try:
                await self._decode_leg(request, prefilled)
                return
            except grpc.aio.AioRpcError as error:  # the decode worker died or hung: migrate (gateway/migration.py)
                if not self._pool.migrations.allows(error, self._migrations):
                    raise
                request = await self._migrate(error)

    async def _decode_leg(self, request: worker_pb2.DecodeRequest, prefilled: float) -> None:
        """Streams the request's Decode on self._decode until it finishes (or a stop string ends it)."""
        assert self._decode is not None
        self._decode_call = self._decode.stream.submit(request, remaining(self._deadline), trace_id=self.trace_id)
        self._decode_state = DecodeState.STREAMING
        observer, first_chunk = self._observer, True
        async for chunk in self._decode_call:
            if first_chunk and observer is not None:  # the gap after the first token: Decode set-up + one step
                observer.decode_started(time.perf_counter() - prefilled)
            first_chunk = False
            self.decoding.set()
            self._decode_steps += chunk.decode_steps
            self._decode_tokens += len(chunk.token_ids)
            if chunk.token_ids and self._emit(list(chunk.token_ids), list(chunk.logprobs)):
                return
            if chunk.finished:
                self._decode_state = DecodeState.FINISHED
                self._finish(chunk.finish_reason or "stop")
                return
        raise Unavailable(f"decode stream of {self.trace_id} ended without finishing")

    async def _migrate(self, error: grpc.aio.AioRpcError) -> worker_pb2.DecodeRequest | None:
        """Admits the request again elsewhere: Reserve, Prefill of prompt + the tokens streamed so far (its
        first token is the stream's next one), and returns the Decode to continue with (None: that token ended
        the request). The lost worker's reservation is released in the background (it may be hung)."""
        job, lost = self.job, self._decode
        assert lost is not None
        self._migrations += 1
        self._pool.migrations.record(self.trace_id, len(self._generated), lost.load.address)
        self._pool.mark_unreachable(lost.load, error)
        self._background(self._pool.release_quietly(lost, self.request_id, self.trace_id))
        self._decode_state, self._decode_call, self._decode = DecodeState.NONE, None, None
        self.request_id = f"{self.trace_id}.{uuid.uuid4().hex[:12]}"
        token_ids = [*job.prompt_ids, *self._generated]
        left = job.params.max_new_tokens - len(self._generated)
        keys = PromptKeys(token_ids)
        self._decode, destination = await self._pool.reserve(self.request_id, len(token_ids), left, self._deadline,
                                                             trace_id=self.trace_id, prompt=keys)
        self._note_decode(keys, destination)
        self._decode_state = DecodeState.RESERVED
        self._lease_deadline = destination.lease_deadline_unix_ms / 1000
        sampling = sampling_to_proto(job.params)
        sampling.max_new_tokens = left
        response = await self._run_prefill(destination, sampling, token_ids, keys)
        first = response.first_token
        if self._emit([first], [response.first_logprob] if response.HasField("first_logprob") else []):
            return None
        if job.ends_on(first) or left == 1:
            self._finish("stop" if job.ends_on(first) else "length")
            return None
        return worker_pb2.DecodeRequest(request_id=self.request_id, lease_id=destination.lease_id, token_ids=token_ids,
                                        first_token=first, sampling=sampling, stream_interval=job.stream_interval)

    def _background(self, work: Coroutine[object, object, None]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _note_decode(self, keys: PromptKeys, destination: kv_pb2.KVDestination) -> None:
        assert self._decode is not None
        address = self._decode.load.address
        route = self.route
        route.decode, route.expected_decode = address, self._pool.overlap(address, keys).page_tokens
        route.actual_decode = decode_cached_tokens(destination)
        if self._observer is not None:
            self._observer.cache_routed("decode", route.expected_decode, route.actual_decode)

    async def _run_prefill(self, destination: kv_pb2.KVDestination, sampling: worker_pb2.WorkerSampling,
                           token_ids: list[int] | None = None,
                           keys: PromptKeys | None = None) -> worker_pb2.PrefillResponse:
        """Prefill on the worker the router ranks first (least loaded; cache-aware with keys: the prompt's page
        keys); if that worker becomes unreachable (UNAVAILABLE: it died) the prompt is sent once more, to another
        reachable prefill worker, into the same destination. token_ids: what to prefill (default the prompt; a
        migrated request's prompt + streamed tokens)."""
        token_ids = self.job.prompt_ids if token_ids is None else token_ids
        try:
            return await self._prefill_on(self._pool.pick_prefill(keys), destination, sampling, token_ids, keys)
        except grpc.aio.AioRpcError as error:
            if error.code() != grpc.StatusCode.UNAVAILABLE:
                raise
            try:
                retry = self._pool.pick_prefill(keys)  # the dead worker is marked unreachable by now
            except Unavailable:
                raise error from None
            logger.warning("prefill worker lost during prefill of %s (%s); retrying once on %s",
                           self.trace_id, error.details(), retry.load.address)
            return await self._prefill_on(retry, destination, sampling, token_ids, keys)

    async def _prefill_on(self, worker: PrefillWorker, destination: kv_pb2.KVDestination,
                          sampling: worker_pb2.WorkerSampling, token_ids: list[int],
                          keys: PromptKeys | None = None) -> worker_pb2.PrefillResponse:
        self._prefill = worker
        route = self.route
        route.prefill, route.actual_prefill = worker.load.address, None
        route.expected_prefill = self._pool.overlap(worker.load.address, keys).lookup_tokens
        self._prefill_state = PrefillState.INFLIGHT
        with worker.load.claim(len(token_ids)):
            try:
                self._prefill_call = worker.stream.submit(
                    worker_pb2.PrefillRequest(request_id=self.request_id, token_ids=token_ids,
                                              sampling=sampling, destination=destination),
                    remaining(self._deadline), trace_id=self.trace_id)
                response = await self._prefill_call
            except grpc.aio.AioRpcError as error:
                self._prefill_state = PrefillState.FAILED
                if error.code() == grpc.StatusCode.UNAVAILABLE:
                    self._pool.mark_unreachable(worker.load, error)
                raise
        self._prefill_state = PrefillState.OK
        route.actual_prefill = response.num_cached_tokens
        if self._observer is not None:
            self._observer.cache_routed("prefill", route.expected_prefill, route.actual_prefill)
        return response

    # --- events -------------------------------------------------------------------------------------
    def _emit(self, token_ids: list[int], logprobs: list[logprobs_pb2.TokenLogprob],
              prompt_logprobs: list[logprobs_pb2.TokenLogprob] | None = None) -> bool:
        """Queues tokens and their text; True when a stop string ended the output."""
        self._completion_tokens += len(token_ids)
        self._generated.extend(token_ids)
        if not self._ttft_ms:  # (a prefill on the decode worker: its first update)
            self._ttft_ms = (time.perf_counter() - self._arrival) * 1000
        if self._observer is not None:
            now = time.perf_counter()
            if self._last_token_at is None:
                self._observer.first_token(now - self._arrival)
            self._observer.tokens(len(token_ids), None if self._last_token_at is None else now - self._last_token_at)
            self._last_token_at = now
        text = self._detok.add(token_ids) if self._detok is not None else ""
        check = self._stops.feed(text)
        self.events.put_nowait(TokensEvent(token_ids, check.text, logprobs, prompt_logprobs or []))
        if check.matched is not None:
            self._finish("stop", check.matched)
            return True
        return False

    def _finish(self, reason: str, stop: str = "") -> None:
        if not stop and self._detok is not None:
            tail = self._stops.feed(self._detok.flush())
            text = tail.text + ("" if tail.matched else self._stops.flush())
            if tail.matched:
                reason, stop = "stop", tail.matched
            if text:
                self.events.put_nowait(TokensEvent([], text))
        self.finished = True
        self._observe_end()
        logger.info("finished (%s): %d prompt (%d cached) + %d generated tokens, TTFT %.1f ms; %s", reason,
                    len(self.job.prompt_ids), self._cached_tokens, self._completion_tokens, self._ttft_ms,
                    self.route.describe())
        self.events.put_nowait(FinishEvent(
            reason, len(self.job.prompt_ids), self._completion_tokens, self._ttft_ms, self._decode_steps,
            self._decode_tokens, stop, self._cached_tokens))

    def _release_observer(self) -> None:
        """Records what was held back (HeldObserver) and reports straight to the observer from now on."""
        if isinstance(self._observer, HeldObserver):
            self._observer = self._observer.release()

    def _observe_end(self) -> None:
        self._release_observer()  # (in order: what was held comes before the finish)
        if self._observer is not None:
            self._observer.finished(time.perf_counter() - self._arrival, self._decode_steps, self._decode_tokens)

    # --- cleanup ------------------------------------------------------------------------------------
    def _cleanup_budget(self) -> float:
        """How long cleanup may wait for the prefill worker to confirm it stopped: as long as it takes,
        until the decode lease lapses (then the decode worker frees the pages itself)."""
        return max(self._cleanup_timeout, self._lease_deadline - time.time() + self._cleanup_timeout)

    async def _cleanup(self) -> None:
        request_id = self.request_id
        if self._prefill_state in (PrefillState.INFLIGHT, PrefillState.FAILED):
            assert self._prefill is not None
            if self._prefill_call is not None:
                self._prefill_call.cancel()
            try:
                await self._prefill.stub.Cancel(worker_pb2.CancelRequest(request_id=request_id),
                                                timeout=self._cleanup_budget(), metadata=self._metadata)
            except grpc.aio.AioRpcError as error:
                logger.warning("could not confirm prefill of %s stopped (%s); its lease will expire",
                               request_id, error.code().name)
                return
            self._prefill_state = PrefillState.FAILED
        if self._decode_state == DecodeState.STREAMING and self._decode_call is not None:
            self._decode_call.cancel()
        if self._decode_state in (DecodeState.RESERVED, DecodeState.STREAMING) and self._decode is not None:
            await self._decode.stub.Release(worker_pb2.ReleaseRequest(request_id=request_id),
                                            timeout=self._cleanup_timeout, metadata=self._metadata)
            self._decode_state = DecodeState.FINISHED
