"""PrefillStream on the prefill worker: many prefills multiplexed over one long-lived bidirectional stream
(the gateway keeps one per worker, which saves setting up an HTTP/2 stream and gRPC call per prompt).

Each request message runs as its own task through the same prefill as the unary Prefill RPC. Its answer is
one response message (the PrefillResponse, or the status the unary call would have ended with), written
under a lock (one stream, many writers); its `reply_sent` is set once that message is written, so an shm
completion record still follows the reply. A failed request does not end the stream. A request whose
timeout_ms passes is cancelled as a unary call whose deadline passed (DEADLINE_EXCEEDED). When the stream
ends or breaks (the gateway closed it or went away) every request still running on it is cancelled as a
cancelled unary call is: no completion record, nothing left in the queue. On shutdown (drain) the streams
stop reading, let their running requests answer and then end, so the gateway sends new prompts elsewhere."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from rpc.internal.v1 import worker_pb2
from rpc.logging_setup import bind_request_id
from rpc.status import details_bin, failure_status

logger = logging.getLogger(__name__)
# The unary-equivalent prefill: (request, reply_sent) -> response; raises what the unary RPC would fail with.
Prefill = Callable[[worker_pb2.PrefillRequest, asyncio.Event], Awaitable[worker_pb2.PrefillResponse]]


def error_reply(request_id: str, status: grpc.Status) -> worker_pb2.PrefillStreamResponse:
    """The message that answers a failed request with `status` (its google.rpc details included)."""
    error = worker_pb2.PrefillStreamError(code=status.code.value[0], message=status.details or "",
                                          status_details=details_bin(status))
    return worker_pb2.PrefillStreamResponse(request_id=request_id, error=error)


class _Session:
    """One open PrefillStream: a reader task starting one task per request, and a write lock."""

    def __init__(self, context: grpc.aio.ServicerContext, prefill: Prefill) -> None:
        self._context = context
        self._prefill = prefill
        self._write_lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[None]] = set()
        self._reader: asyncio.Task[None] | None = None
        self._draining = False

    async def run(self, requests: AsyncIterator[worker_pb2.PrefillStreamRequest]) -> None:
        self._reader = asyncio.ensure_future(self._read(requests))
        try:
            await self._reader
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if not self._draining or (current is not None and current.cancelling()):
                raise  # the stream broke (or the server's grace ran out)
            if self._tasks:  # draining: the requests already read answer, then the stream ends
                await asyncio.wait(set(self._tasks))
        finally:
            for task in self._tasks:  # the stream ended or broke: cancel what still runs, as a cancelled call
                task.cancel()

    def drain(self) -> None:
        self._draining = True
        if self._reader is not None:
            self._reader.cancel()

    async def _read(self, requests: AsyncIterator[worker_pb2.PrefillStreamRequest]) -> None:
        async for message in requests:
            task = asyncio.create_task(self._serve(message))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _serve(self, message: worker_pb2.PrefillStreamRequest) -> None:
        request_id = message.request.request_id
        bind_request_id(message.trace_id or request_id)  # this task's log lines name the request
        reply_sent = asyncio.Event()
        timeout = message.timeout_ms / 1000 if message.timeout_ms > 0 else None
        try:
            try:
                async with asyncio.timeout(timeout):
                    response = await self._prefill(message.request, reply_sent)
                reply = worker_pb2.PrefillStreamResponse(request_id=request_id, response=response)
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if current is not None and current.cancelling():
                    raise  # the stream ended: nobody to answer
                reply = error_reply(request_id, failure_status("PrefillStream", _Cancelled("prefill cancelled")))
            except Exception as error:  # noqa: BLE001 - every failure is answered with its status
                reply = error_reply(request_id, failure_status("PrefillStream", error))
            await self._write(reply)
        finally:
            reply_sent.set()  # written (or never will be): the completion record may follow

    async def _write(self, reply: worker_pb2.PrefillStreamResponse) -> None:
        try:
            async with self._write_lock:
                await self._context.write(reply)
        except (grpc.RpcError, asyncio.InvalidStateError, RuntimeError) as error:  # the stream is gone
            logger.info("answer to %s not sent: the prefill stream ended (%r)", reply.request_id, error)


class _Cancelled(Exception):
    """A request cancelled on the worker (Cancel RPC) while its stream lives on."""

    grpc_status = "CANCELLED"


class PrefillStreams:
    """The open PrefillStream calls of one servicer, so that shutdown can drain them."""

    def __init__(self) -> None:
        self._sessions: set[_Session] = set()

    async def serve(self, requests: AsyncIterator[worker_pb2.PrefillStreamRequest],
                    context: grpc.aio.ServicerContext, prefill: Prefill) -> None:
        """The body of the PrefillStream RPC: returns when the stream ends (cancelled when it breaks)."""
        session = _Session(context, prefill)
        self._sessions.add(session)
        try:
            await session.run(requests)
        finally:
            self._sessions.discard(session)

    def drain(self) -> None:
        """Every open stream stops reading; each ends once the requests it read have been answered."""
        for session in list(self._sessions):
            session.drain()
