"""PrefillStream on the prefill worker: many prompts multiplexed over one long-lived bidirectional stream (the
gateway keeps one per worker, which saves setting up an HTTP/2 stream and gRPC call per prompt).

Each request message runs as its own task (rpc/stream_sessions.py). Its answer is one response message (the
PrefillResponse, or the request's status), written under a lock (one stream, many writers); its `reply_sent`
is set once that message is written, so an shm completion record follows the reply. A failed request does not
end the stream. A request whose timeout_ms passes is cancelled and answered DEADLINE_EXCEEDED. When the stream
ends or breaks (the gateway closed it or went away) every request still running on it is cancelled: no
completion record, nothing left in the queue. On shutdown (drain) the streams stop reading, let their running
requests answer and then end, so the gateway sends new prompts elsewhere."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import grpc

from rpc.internal.v1 import worker_pb2
from rpc.logging_setup import bind_request_id
from rpc.status import details_bin, failure_status
from rpc.stream_sessions import Cancelled, StreamSession

logger = logging.getLogger(__name__)
# One prompt: (request, reply_sent) -> response; raises what the request fails with.
Prefill = Callable[[worker_pb2.PrefillRequest, asyncio.Event], Awaitable[worker_pb2.PrefillResponse]]


def error_reply(request_id: str, status: grpc.Status) -> worker_pb2.PrefillStreamResponse:
    """The message that answers a failed request with `status` (its google.rpc details included)."""
    error = worker_pb2.PrefillStreamError(code=status.code.value[0], message=status.details or "",
                                          status_details=details_bin(status))
    return worker_pb2.PrefillStreamResponse(request_id=request_id, error=error)


class PrefillSession(StreamSession[worker_pb2.PrefillStreamRequest]):
    """One open PrefillStream: a task per request, answers written under a lock."""

    def __init__(self, context: grpc.aio.ServicerContext, prefill: Prefill) -> None:
        super().__init__()
        self._context = context
        self._prefill = prefill
        self._write_lock = asyncio.Lock()

    def receive(self, message: worker_pb2.PrefillStreamRequest) -> None:
        self.start_task(self._serve(message))

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
                reply = error_reply(request_id, failure_status("PrefillStream", Cancelled("prefill cancelled")))
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
