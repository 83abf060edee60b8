"""DecodeStream on the decode worker: many Decodes multiplexed over one long-lived bidirectional stream (the
gateway keeps one per worker), so that an engine step costs one gRPC message per stream, not one per request.

Each request message runs as its own task (rpc/stream_sessions.py) through DecodeService.run_decode
(admission, lease claim, stream_interval, abort when left early), which waits there until the request ends:
its updates go straight into the session's outbox as each engine delivery is sorted (the delivery callback puts
them there: no task wakes per request per step), and one writer task sends what the outbox holds as one
message, so one delivery is one message; while a write is in flight the outbox keeps collecting, merging a
request's updates into one entry (never past a finished one). A failed request is answered with an error entry (its status) and the
stream goes on. A cancel message, a request's timeout_ms passing (DEADLINE_EXCEEDED), or the stream ending or
breaking ends a request: the generator is closed (the engine aborts the request) and Release frees whatever
it still holds. On shutdown
(drain) the streams stop reading, let their running requests finish, send what is left and then end."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from decode_worker.admission import DecodeUpdate, merge_updates
from decode_worker.streams import Sink
from rpc.convert import logprob_to_proto
from rpc.internal.v1 import worker_pb2
from rpc.logging_setup import bind_request_id
from rpc.status import AlreadyExists, details_bin, failure_status
from rpc.stream_sessions import Cancelled, StreamSession

logger = logging.getLogger(__name__)
# Runs a request, its updates to the sink, until it ends (raises what the request fails with).
Run = Callable[[worker_pb2.DecodeRequest, Sink], Awaitable[None]]


def error_entry(request_id: str, status: grpc.Status) -> worker_pb2.DecodeStreamError:
    """The entry that ends a failed request with `status` (its google.rpc details included)."""
    return worker_pb2.DecodeStreamError(request_id=request_id, code=status.code.value[0], message=status.details or "",
                                        status_details=details_bin(status))


def update_entry(request_id: str, update: DecodeUpdate) -> worker_pb2.DecodeStreamUpdate:
    entry = worker_pb2.DecodeStreamUpdate(request_id=request_id, token_ids=update.token_ids, finished=update.finished,
                                          finish_reason=update.finish_reason or "", decode_steps=update.steps)
    if update.logprobs:
        entry.logprobs.extend(logprob_to_proto(logprob) for logprob in update.logprobs)
    return entry


class Outbox:
    """What the requests on one stream produced and the writer has not sent yet, in order: one entry per
    request (its updates since the last message, merged when taken), and the error entries."""

    def __init__(self) -> None:
        self._updates: list[tuple[str, list[DecodeUpdate]]] = []
        self._open: dict[str, list[DecodeUpdate]] = {}  # entries later updates of the request merge into
        self._errors: list[worker_pb2.DecodeStreamError] = []

    def __bool__(self) -> bool:
        return bool(self._updates or self._errors)

    def add(self, request_id: str, update: DecodeUpdate) -> None:
        pending = self._open.get(request_id)
        if pending is None:
            pending = []
            self._updates.append((request_id, pending))
            self._open[request_id] = pending
        pending.append(update)
        if update.finished:  # nothing merges past a finished update
            del self._open[request_id]

    def fail(self, request_id: str, status: grpc.Status) -> None:
        self._open.pop(request_id, None)
        self._errors.append(error_entry(request_id, status))

    def take(self) -> worker_pb2.DecodeStreamResponse:
        """Everything collected so far, as one message (the outbox is empty afterwards)."""
        message = worker_pb2.DecodeStreamResponse(
            updates=[update_entry(request_id, merge_updates(updates)) for request_id, updates in self._updates],
            errors=self._errors)
        self._updates, self._open, self._errors = [], {}, []
        return message


class DecodeSession(StreamSession[worker_pb2.DecodeStreamRequest]):
    """One open DecodeStream: a task per request (rpc/stream_sessions.py), the outbox and its writer task.
    release_soon(request_id): frees what a request that did not finish still holds."""

    def __init__(self, context: grpc.aio.ServicerContext, run: Run,
                 release_soon: Callable[[str], None]) -> None:
        super().__init__()
        self._context = context
        self._run = run
        self._release_soon = release_soon
        self._outbox = Outbox()
        self._ready = asyncio.Event()  # the outbox has something (or the stream is ending)
        self._closing = False
        self._running: dict[str, asyncio.Task[bool]] = {}
        self._writer: asyncio.Task[None] | None = None

    async def run(self, requests: AsyncIterator[worker_pb2.DecodeStreamRequest]) -> None:
        self._writer = asyncio.create_task(self._write())
        await super().run(requests)

    async def drained(self) -> None:
        """Draining: the requests already read have finished; what is left is sent, then the stream ends."""
        self._closing = True
        self._ready.set()
        assert self._writer is not None
        await self._writer

    def ended(self) -> None:
        if self._writer is not None:
            self._writer.cancel()

    def receive(self, message: worker_pb2.DecodeStreamRequest) -> None:
        if message.HasField("request"):
            self._start(message)
        else:
            task = self._running.get(message.cancel_request_id)
            if task is not None:
                task.cancel()

    def _start(self, message: worker_pb2.DecodeStreamRequest) -> None:
        request_id = message.request.request_id
        if request_id in self._running:  # (the one running keeps its id; this one is refused)
            self._fail(request_id, AlreadyExists(f"request {request_id} is already decoding on this stream"))
            return
        task = self.start_task(self._serve(message))
        self._running[request_id] = task
        task.add_done_callback(lambda _: self._ended(request_id, task))

    def _ended(self, request_id: str, task: asyncio.Task[bool]) -> None:
        """A request that did not finish (failed, cancelled, even before it started) has whatever it still
        holds freed."""
        if self._running.get(request_id) is task:
            del self._running[request_id]
        if task.cancelled() or not task.result():
            self._release_soon(request_id)

    async def _serve(self, message: worker_pb2.DecodeStreamRequest) -> bool:
        """Runs one request, its updates and failure into the outbox; True when it finished."""
        request, finished = message.request, False
        request_id = request.request_id
        bind_request_id(message.trace_id or request_id)  # this task's log lines name the request
        timeout = message.timeout_ms / 1000 if message.timeout_ms > 0 else None
        outbox, ready = self._outbox, self._ready

        def sink(update: DecodeUpdate) -> None:  # (on the delivery callback)
            outbox.add(request_id, update)
            ready.set()

        try:
            async with asyncio.timeout(timeout):
                await self._run(request, sink)
            finished = True
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise  # cancelled (cancel message, stream ended): nobody to answer
            self._fail(request_id, Cancelled("decode cancelled"))
        except Exception as error:  # noqa: BLE001 - every failure is answered with its status
            self._fail(request_id, error)
        return finished

    def _fail(self, request_id: str, error: Exception) -> None:
        self._outbox.fail(request_id, failure_status("DecodeStream", error))
        self._ready.set()

    async def _write(self) -> None:
        """Sends the outbox as one message whenever it has something; what arrives during a write waits
        (merged per request) for the next. Returns once the stream is ending and the outbox is empty."""
        while True:
            if not self._outbox:
                if self._closing:
                    return
                self._ready.clear()
                await self._ready.wait()  # (woken after every request the same delivery woke: queued later)
                continue
            try:
                await self._context.write(self._outbox.take())
            except (grpc.RpcError, asyncio.InvalidStateError, RuntimeError) as error:  # the stream is gone
                logger.info("decode stream updates not sent: the stream ended (%r)", error)
                return
            await asyncio.sleep(0)  # a delivery callback queued during the write runs first: its updates join
