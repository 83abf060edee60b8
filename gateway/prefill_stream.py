"""The gateway's side of PrefillStream: one long-lived, multiplexed stream per prefill worker carries every
prompt sent there (no HTTP/2 stream or gRPC call set-up per first token: ~0.5 ms per request measured here).

A request is a future resolved by the reader task (worker_stream.OpenStream) when the response naming its
request_id comes. Every failure is a grpc.aio.AioRpcError: a request the worker refused gets the worker's
status; a stream that broke (the worker died) fails every request still pending on it with UNAVAILABLE (the
stream's own status when it was refused outright, e.g. UNAUTHENTICATED) and is opened again by the next
request. A request cancelled by its caller is dropped here (not sent when it was still waiting to be);
stopping the work on the worker is the Cancel RPC's job. The per-request deadline travels as timeout_ms and
is also kept here (worker_stream.LOCAL_DEADLINE_GRACE_S later)."""
from __future__ import annotations

import asyncio

import grpc

from gateway.worker_stream import (LOCAL_DEADLINE_GRACE_S, Metadata, OpenStream, WorkerStream, code_of, rpc_error,
                                   timeout_ms)
from rpc.internal.v1 import worker_pb2, worker_pb2_grpc

Answer = asyncio.Future[worker_pb2.PrefillResponse]


class _Open(OpenStream[worker_pb2.PrefillStreamRequest, worker_pb2.PrefillStreamResponse, Answer]):
    async def send(self, message: worker_pb2.PrefillStreamRequest, pending: Answer) -> None:
        if not pending.done():  # a request cancelled before it was sent is not sent
            await self.call.write(message)

    def deliver(self, message: worker_pb2.PrefillStreamResponse) -> None:
        future = self.pending.get(message.request_id)
        if future is None or future.done():  # dropped by its caller meanwhile
            return
        if message.HasField("response"):
            future.set_result(message.response)
        else:
            error = message.error
            future.set_exception(rpc_error(code_of(error.code), error.message, error.status_details))

    def fail_one(self, pending: Answer, error: grpc.aio.AioRpcError) -> None:
        if not pending.done():
            pending.set_exception(error)


class PrefillStream(WorkerStream[worker_pb2.PrefillStreamRequest, worker_pb2.PrefillStreamResponse, Answer]):
    """The multiplexed Prefill of one prefill worker (address: for messages only)."""

    def __init__(self, stub: worker_pb2_grpc.PrefillServiceStub, metadata: Metadata, address: str) -> None:
        super().__init__(address, metadata)
        self._stub = stub

    def _connect(self) -> _Open:
        return _Open(self._stub.PrefillStream(metadata=self._metadata), f"prefill stream to {self._address}")

    async def prefill(self, request: worker_pb2.PrefillRequest, timeout: float | None,
                      trace_id: str = "") -> worker_pb2.PrefillResponse:
        return await self.submit(request, timeout, trace_id)

    def submit(self, request: worker_pb2.PrefillRequest, timeout: float | None, trace_id: str = "") -> Answer:
        """Queues the request on the stream (opened if need be): a future of its response (no task of its own;
        cancelling the future drops the request, which is not sent if it was still waiting to be). trace_id:
        the x-request-id naming the request in the worker's log."""
        loop = asyncio.get_running_loop()
        future: Answer = loop.create_future()
        if self.closed:
            future.set_exception(rpc_error(grpc.StatusCode.CANCELLED, "the gateway is shutting down"))
            return future
        stream, request_id = self.current(), request.request_id
        if request_id in stream.pending:
            future.set_exception(rpc_error(grpc.StatusCode.ALREADY_EXISTS,
                                           f"request {request_id} is already being prefilled"))
            return future
        stream.pending[request_id] = future
        timer = None if timeout is None else loop.call_later(timeout + LOCAL_DEADLINE_GRACE_S, _expire, future)

        def forget(_: Answer) -> None:
            if stream.pending.get(request_id) is future:
                del stream.pending[request_id]
            if timer is not None:
                timer.cancel()

        future.add_done_callback(forget)
        message = worker_pb2.PrefillStreamRequest(request=request, trace_id=trace_id, timeout_ms=timeout_ms(timeout))
        stream.outbox.put_nowait((message, future))
        return future


def _expire(future: Answer) -> None:
    """The local deadline passed: DEADLINE_EXCEEDED."""
    if not future.done():
        future.set_exception(rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))
