"""The gateway's side of DecodeStream: one long-lived, multiplexed stream per decode worker carries every
running request's tokens of an engine step in one message instead of one message per request (the
per-message gRPC work was most of the decode worker's CPU per token past the engine's).

The writer task (worker_stream.OpenStream) sends the request and cancel messages in order, and the reader task
hands each update and error entry to its request's DecodeCall: async iteration of DecodeStreamUpdate chunks,
cancel(), and a grpc.aio.AioRpcError for a request that failed: the worker's status for a request it failed;
UNAVAILABLE for every request on a stream that broke (the worker died; the stream's own status when it was
refused outright, e.g. UNAUTHENTICATED), after which the next request opens a new stream. cancel() (or the
local deadline) sends a cancel message, which aborts the request on the worker; a request cancelled before it
was sent is not sent. The per-request deadline travels as timeout_ms and is also kept here
(LOCAL_DEADLINE_GRACE_S later), as prefill_stream.py does."""
from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable

import grpc

from gateway.worker_stream import (LOCAL_DEADLINE_GRACE_S, Metadata, OpenStream, WorkerStream, code_of, rpc_error,
                                   timeout_ms)
from rpc.internal.v1 import worker_pb2, worker_pb2_grpc


class DecodeCall:
    """One request's chunks on a DecodeStream: async-iterable until its finished chunk, cancel()-able.
    on_end(call): called once when it ends (finished, failed or cancelled)."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.sent = False  # the request message is written (a cancel must follow it to the worker)
        self.ended = False  # the finished chunk or the failure is queued: nothing more comes
        self.ended_by_worker = False  # it finished or failed there (nothing to cancel on the worker)
        self.on_end: Callable[[DecodeCall], None] | None = None
        # chunks, then possibly an exception
        self._items: collections.deque[worker_pb2.DecodeStreamUpdate | BaseException] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None

    def __aiter__(self) -> DecodeCall:
        return self

    async def __anext__(self) -> worker_pb2.DecodeStreamUpdate:
        while not self._items:
            if self.ended:
                raise StopAsyncIteration
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        item = self._items.popleft()
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> bool:
        """False when it had ended already; iterating raises CancelledError."""
        return self.fail(asyncio.CancelledError())

    def put(self, chunk: worker_pb2.DecodeStreamUpdate) -> None:
        """A chunk from the worker (the finished one ends the call)."""
        if not self.ended:
            self._items.append(chunk)
            if chunk.finished:
                self._end(by_worker=True)
            self._wake()

    def fail(self, error: BaseException, by_worker: bool = False) -> bool:
        """Ends the call with `error` (by_worker: the worker ended the request itself, or is gone)."""
        if self.ended:
            return False
        self._items.append(error)
        self._end(by_worker)
        self._wake()
        return True

    def _end(self, by_worker: bool) -> None:
        self.ended, self.ended_by_worker = True, by_worker
        if self.on_end is not None:
            self.on_end(self)

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class _Open(OpenStream[worker_pb2.DecodeStreamRequest, worker_pb2.DecodeStreamResponse, DecodeCall]):
    async def send(self, message: worker_pb2.DecodeStreamRequest, call: DecodeCall) -> None:
        if not message.HasField("request"):  # a cancel
            await self.call.write(message)
            return
        if call.ended:  # a request cancelled before it was sent is not sent
            return
        await self.call.write(message)
        call.sent = True
        if call.ended and not call.ended_by_worker:  # cancelled while being sent: tell the worker
            self.cancel_on_worker(call)

    def deliver(self, message: worker_pb2.DecodeStreamResponse) -> None:
        pending = self.pending
        for update in message.updates:
            call = pending.get(update.request_id)
            if call is not None:  # (None: dropped by its caller meanwhile)
                call.put(update)
        for error in message.errors:
            call = pending.get(error.request_id)
            if call is not None:
                call.fail(rpc_error(code_of(error.code), error.message, error.status_details), by_worker=True)

    def fail_one(self, call: DecodeCall, error: grpc.aio.AioRpcError) -> None:
        call.fail(error, by_worker=True)

    def cancel_on_worker(self, call: DecodeCall) -> None:
        """The caller ended a request the worker may still run: a cancel message aborts it there."""
        if call.sent and not self.broken:
            self.outbox.put_nowait((worker_pb2.DecodeStreamRequest(cancel_request_id=call.request_id), call))


class DecodeStream(WorkerStream[worker_pb2.DecodeStreamRequest, worker_pb2.DecodeStreamResponse, DecodeCall]):
    """The multiplexed Decode of one decode worker (address: for messages only)."""

    def __init__(self, stub: worker_pb2_grpc.DecodeServiceStub, metadata: Metadata, address: str) -> None:
        super().__init__(address, metadata)
        self._stub = stub
        self.hung: str | None = None  # why the worker is taken for hung (fail_hung), until a probe answers again
        self._hang_waiters: set[asyncio.Future[str]] = set()

    def _connect(self) -> _Open:
        return _Open(self._stub.DecodeStream(metadata=self._metadata), f"decode stream to {self._address}")

    def submit(self, request: worker_pb2.DecodeRequest, timeout: float | None, trace_id: str = "") -> DecodeCall:
        """Queues the request on the stream (opened if need be); no task of its own. trace_id: the x-request-id
        naming the request in the worker's log."""
        request_id = request.request_id
        call = DecodeCall(request_id)
        if self.closed:
            call.fail(rpc_error(grpc.StatusCode.CANCELLED, "the gateway is shutting down"))
            return call
        if self.hung is not None:  # a stream opened now would wait on a stopped worker: migrate instead
            call.fail(rpc_error(grpc.StatusCode.UNAVAILABLE, self.hung), by_worker=True)
            return call
        stream = self.current()
        assert isinstance(stream, _Open)
        if request_id in stream.pending:
            call.fail(rpc_error(grpc.StatusCode.ALREADY_EXISTS, f"request {request_id} is already decoding"))
            return call
        if not stream.pending:  # the silence clock (silent_for) starts when an idle stream gets work
            stream.last_message = time.monotonic()
        stream.pending[request_id] = call
        timer = None if timeout is None else asyncio.get_running_loop().call_later(
            timeout + LOCAL_DEADLINE_GRACE_S, _expire, call)

        def forget(_: DecodeCall) -> None:
            if stream.pending.get(request_id) is call:
                del stream.pending[request_id]
            if timer is not None:
                timer.cancel()
            if not call.ended_by_worker:  # cancelled here, or past the local deadline: stop it there too
                stream.cancel_on_worker(call)

        call.on_end = forget
        message = worker_pb2.DecodeStreamRequest(request=request, trace_id=trace_id, timeout_ms=timeout_ms(timeout))
        stream.outbox.put_nowait((message, call))
        return call

    def silent_for(self, now: float) -> float | None:
        """Seconds since the open stream's last message (or its opening) while requests are in flight on it;
        None when nothing runs on it (gateway/liveness.py)."""
        stream = self._open
        if stream is None or stream.broken or not stream.pending:
            return None
        return now - stream.last_message

    def fail_hung(self, reason: str) -> int:
        """The worker stopped answering: its open stream fails (every request on it UNAVAILABLE with `reason`;
        the call is cancelled, so the worker aborts them when it resumes), requests submitted from now until
        answered() fail the same way at once, and hang_signal() futures resolve with `reason`. Returns how many
        requests failed."""
        self.hung = reason
        for waiter in self._hang_waiters:
            if not waiter.done():
                waiter.set_result(reason)
        stream = self._open
        if stream is None or stream.broken:
            return 0
        count = len(stream.pending)
        stream.fail(None, details=reason)
        return count

    def answered(self) -> None:
        """A health probe answered: the worker takes requests again."""
        self.hung = None

    def hang_signal(self) -> asyncio.Future[str]:
        """A future that resolves with the reason when the worker is taken for hung (at once if it is now);
        drop_hang_signal() it when done waiting. Lets a unary call in flight to the worker (Reserve) stop
        waiting on a stopped process."""
        waiter: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        if self.hung is not None:
            waiter.set_result(self.hung)
        self._hang_waiters.add(waiter)
        return waiter

    def drop_hang_signal(self, waiter: asyncio.Future[str]) -> None:
        self._hang_waiters.discard(waiter)


def _expire(call: DecodeCall) -> None:
    """The local deadline passed: DEADLINE_EXCEEDED."""
    call.fail(rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))
