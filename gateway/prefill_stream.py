"""The gateway's side of PrefillStream: one long-lived, multiplexed Prefill stream per prefill worker, which
saves the HTTP/2 stream and gRPC call set-up a unary Prefill pays on every first token (~0.5 ms per request
measured here).

The stream is opened by the first request that needs it; a writer task sends the request messages in
order (a gRPC call takes one write at a time, and a write cancelled half-way would cancel the whole call),
and a reader task resolves each request's future by its request_id. Every failure is a
grpc.aio.AioRpcError carrying the code the unary call would have ended with, so the orchestrator's handling
is the same for both: a request the worker refused gets the worker's status; a stream that broke (the
worker died) fails every request still pending on it with UNAVAILABLE (the stream's own status when it was
refused outright, e.g. UNAUTHENTICATED) and is opened again by the next request. A request cancelled by
its caller is dropped here (not sent when it was still waiting to be); stopping the work on the worker is
the Cancel RPC's job, as on the unary path. The per-request deadline travels as timeout_ms and is also
kept here (worker_stream.LOCAL_DEADLINE_GRACE_S later)."""
from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc

from gateway.worker_stream import LOCAL_DEADLINE_GRACE_S, Metadata, code_of, ended_status, rpc_error, stop_tasks
from rpc.internal.v1 import worker_pb2, worker_pb2_grpc
from rpc.logging_setup import REQUEST_ID_KEY

logger = logging.getLogger(__name__)


class _Open:
    """One PrefillStream call with its writer and reader tasks and the requests waiting on it."""

    def __init__(self, stub: worker_pb2_grpc.PrefillServiceStub, metadata: Metadata, address: str) -> None:
        self.address = address
        self.call = stub.PrefillStream(metadata=metadata)
        self.pending: dict[str, asyncio.Future[worker_pb2.PrefillResponse]] = {}
        self.outbox: asyncio.Queue[tuple[worker_pb2.PrefillStreamRequest, asyncio.Future[Any]]] = asyncio.Queue()
        self.broken = False
        self._writer = asyncio.create_task(self._write())
        self._reader = asyncio.create_task(self._read())

    async def _write(self) -> None:
        try:
            while True:
                message, future = await self.outbox.get()
                if not future.done():  # a request cancelled before it was sent is not sent
                    await self.call.write(message)
        except asyncio.CancelledError:
            raise
        except (grpc.RpcError, asyncio.InvalidStateError) as error:
            self.fail(error)

    async def _read(self) -> None:
        try:
            while True:
                message = await self.call.read()
                if message is grpc.aio.EOF:
                    self.fail(None)
                    return
                future = self.pending.get(message.request_id)
                if future is None or future.done():  # dropped by its caller meanwhile
                    continue
                if message.HasField("response"):
                    future.set_result(message.response)
                else:
                    error = message.error
                    future.set_exception(rpc_error(code_of(error.code), error.message, error.status_details))
        except asyncio.CancelledError:
            raise
        except grpc.RpcError as error:
            self.fail(error)

    def fail(self, error: BaseException | None, closing: bool = False) -> None:
        """The stream is over: every pending request fails (UNAVAILABLE, unless the worker refused the stream
        itself with another code, or the gateway is closing: CANCELLED); the next request opens a new one."""
        if self.broken:
            return
        self.broken = True
        code, details = ended_status(f"prefill stream to {self.address}", error, closing)
        if self.pending:
            logger.warning("%s; failing %d pending prefills with %s", details, len(self.pending), code.name)
        for future in self.pending.values():
            if not future.done():
                future.set_exception(rpc_error(code, details))
        stop_tasks(self._writer, self._reader)
        self.call.cancel()


class PrefillStream:
    """The multiplexed Prefill of one prefill worker (address: for messages only)."""

    def __init__(self, stub: worker_pb2_grpc.PrefillServiceStub, metadata: Metadata, address: str) -> None:
        self._stub = stub
        self._metadata = tuple(metadata)
        self._address = address
        self._open: _Open | None = None
        self._closed = False

    def call(self, request: worker_pb2.PrefillRequest, timeout: float | None,
             metadata: Metadata = ()) -> asyncio.Future[worker_pb2.PrefillResponse]:
        """What stub.Prefill(request, timeout=, metadata=) does, over the stream: an awaitable with cancel().
        The x-request-id in metadata names the request in the worker's log."""
        trace_id = next((str(value) for key, value in metadata if key == REQUEST_ID_KEY), "")
        return self.submit(request, timeout, trace_id)

    async def prefill(self, request: worker_pb2.PrefillRequest, timeout: float | None,
                      trace_id: str = "") -> worker_pb2.PrefillResponse:
        return await self.submit(request, timeout, trace_id)

    def submit(self, request: worker_pb2.PrefillRequest, timeout: float | None,
               trace_id: str = "") -> asyncio.Future[worker_pb2.PrefillResponse]:
        """Queues the request on the stream (opened if need be): a future of its response (no task of its own;
        cancelling the future drops the request, which is not sent if it was still waiting to be)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[worker_pb2.PrefillResponse] = loop.create_future()
        if self._closed:
            future.set_exception(rpc_error(grpc.StatusCode.CANCELLED, "the gateway is shutting down"))
            return future
        if self._open is None or self._open.broken:
            self._open = _Open(self._stub, self._metadata, self._address)
        stream, request_id = self._open, request.request_id
        if request_id in stream.pending:
            future.set_exception(rpc_error(grpc.StatusCode.ALREADY_EXISTS,
                                           f"request {request_id} is already being prefilled"))
            return future
        stream.pending[request_id] = future
        timer = None if timeout is None else loop.call_later(timeout + LOCAL_DEADLINE_GRACE_S, _expire, future)

        def forget(_: asyncio.Future[Any]) -> None:
            if stream.pending.get(request_id) is future:
                del stream.pending[request_id]
            if timer is not None:
                timer.cancel()

        future.add_done_callback(forget)
        message = worker_pb2.PrefillStreamRequest(request=request, trace_id=trace_id,
                                                  timeout_ms=0 if timeout is None else max(1, round(timeout * 1000)))
        stream.outbox.put_nowait((message, future))
        return future

    async def close(self) -> None:
        """Ends the stream (gateway shutdown): requests still pending fail CANCELLED."""
        self._closed = True
        if self._open is not None:
            self._open.fail(None, closing=True)


def _expire(future: asyncio.Future[Any]) -> None:
    """The local deadline passed: DEADLINE_EXCEEDED, as a unary call's."""
    if not future.done():
        future.set_exception(rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))
