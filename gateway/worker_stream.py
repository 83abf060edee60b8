"""What the gateway's long-lived, multiplexed worker streams share (prefill_stream.py, decode_stream.py): one
open stream call with its writer task (a gRPC call takes one write at a time, and a write cancelled half-way
would cancel the whole call, so one task sends the outbox in order), its reader task (each message handed to
the stream's requests) and its fail loop (a stream that is over fails every request pending on it); the
handle that opens a stream when the first request needs it and again after one broke; and the errors
requests fail with (grpc.aio.AioRpcError carrying the status the worker answered with)."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Generic, TypeVar

import grpc

from rpc.status import STATUS_DETAILS_KEY

logger = logging.getLogger(__name__)
# The local deadline fires this much after the request's: the worker's own DEADLINE_EXCEEDED answer (and the
# gateway's incoming call, whose deadline this is) end the request first; the local timer only covers a worker
# that never answers.
LOCAL_DEADLINE_GRACE_S = 0.1
# How long a failed write waits for its call's final status (the call is over by then; this only bounds it).
WRITE_FAILURE_STATUS_WAIT_S = 5.0
ACCEPT_WAIT_S = 30.0  # how long the first write waits for the worker to accept the stream
Metadata = Sequence[tuple[str, str | bytes]]
Sent = TypeVar("Sent")  # a request message of the stream
Received = TypeVar("Received")  # a response message of the stream
Pending = TypeVar("Pending")  # what a request waits on (a future, a DecodeCall)


def rpc_error(code: grpc.StatusCode, details: str, status_details: bytes = b"") -> grpc.aio.AioRpcError:
    """The error of a request that ended with (code, details); status_details: its google.rpc.Status."""
    trailing = grpc.aio.Metadata((STATUS_DETAILS_KEY, status_details)) if status_details else grpc.aio.Metadata()
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, details)


def code_of(value: int) -> grpc.StatusCode:
    """The grpc.StatusCode of a status carried as its number (UNKNOWN for a number that names none)."""
    return next((code for code in grpc.StatusCode if code.value[0] == value), grpc.StatusCode.UNKNOWN)


def ended_status(name: str, error: BaseException | None, closing: bool) -> tuple[grpc.StatusCode, str]:
    """(code, details) for the requests pending on a stream (`name`: e.g. "prefill stream to host:port") that
    is over: UNAVAILABLE (so the request may be migrated or retried), unless the worker refused the stream
    itself with another code, or the gateway is closing (CANCELLED)."""
    if closing:
        return grpc.StatusCode.CANCELLED, "the gateway is shutting down"
    if not isinstance(error, grpc.aio.AioRpcError):
        return grpc.StatusCode.UNAVAILABLE, f"{name} ended"
    details = f"{name} broke: {error.code().name} {error.details()}"
    # A worker ends a stream itself only to refuse it (e.g. UNAUTHENTICATED); these codes mean the stream broke
    # under it (INTERNAL: gRPC core's "Internal error from Core" when a write meets a peer that died).
    if error.code() in (grpc.StatusCode.OK, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN,
                        grpc.StatusCode.INTERNAL):
        return grpc.StatusCode.UNAVAILABLE, details
    return error.code(), details


def timeout_ms(timeout: float | None) -> int:
    """A request's deadline as the stream messages carry it (0: none)."""
    return 0 if timeout is None else max(1, round(timeout * 1000))


class OpenStream(Generic[Sent, Received, Pending]):
    """One open stream call: `pending` maps request ids to what their callers wait on; `outbox` holds the
    messages to send, each with the request it belongs to. Subclasses say what a message means (deliver),
    whether one is still worth sending and what follows its sending (send), and how a request fails (fail_one)."""

    def __init__(self, call: grpc.aio.StreamStreamCall, name: str) -> None:
        self.call = call
        self.name = name
        self.pending: dict[str, Pending] = {}
        self.outbox: asyncio.Queue[tuple[Sent, Pending]] = asyncio.Queue()
        self.broken = False
        self.last_message = time.monotonic()  # the per-step liveness signal (gateway/liveness.py)
        self._writer = asyncio.create_task(self._write())
        self._reader = asyncio.create_task(self._read())

    async def send(self, message: Sent, pending: Pending) -> None:
        await self.call.write(message)

    def deliver(self, message: Received) -> None:
        raise NotImplementedError

    def fail_one(self, pending: Pending, error: grpc.aio.AioRpcError) -> None:
        raise NotImplementedError

    async def _write(self) -> None:
        try:
            await self._accepted()
            while True:
                message, pending = await self.outbox.get()
                await self.send(message, pending)
        except asyncio.CancelledError:
            raise
        except (grpc.RpcError, asyncio.InvalidStateError) as error:
            self.fail(await self._why_writes_failed(error))

    async def _accepted(self) -> None:
        """Waits for the worker's initial metadata (rpc/stream_sessions.py sends it as the stream is accepted)
        before the first write: a write that meets a call the worker is refusing ends it with gRPC core's
        INTERNAL in place of the worker's own status (UNAUTHENTICATED). A worker silent past
        ACCEPT_WAIT_S is written to anyway (each request's own deadline still applies)."""
        try:
            await asyncio.wait_for(self.call.initial_metadata(), ACCEPT_WAIT_S)
        except (asyncio.TimeoutError, grpc.RpcError):
            pass

    async def _why_writes_failed(self, error: BaseException) -> BaseException:
        """A write fails (gRPC core: INTERNAL) when the call has already ended, e.g. the worker refused the
        stream with UNAUTHENTICATED while the first request was being written: the call's own status says why."""
        try:
            code = await asyncio.wait_for(self.call.code(), WRITE_FAILURE_STATUS_WAIT_S)
            details = await self.call.details()
        except (asyncio.TimeoutError, grpc.RpcError):
            return error
        if code is None or code == grpc.StatusCode.OK:
            return error
        return rpc_error(code, details or "")

    async def _read(self) -> None:
        try:
            while True:
                message = await self.call.read()
                if message is grpc.aio.EOF:
                    self.fail(None)
                    return
                self.last_message = time.monotonic()
                self.deliver(message)
        except asyncio.CancelledError:
            raise
        except grpc.RpcError as error:
            self.fail(error)

    def fail(self, error: BaseException | None, closing: bool = False, details: str | None = None) -> None:
        """The stream is over: every pending request fails (UNAVAILABLE, unless the worker refused the stream
        itself with another code, or the gateway is closing: CANCELLED; `details` replaces the message); the
        next request opens a new one."""
        if self.broken:
            return
        self.broken = True
        code, ended = ended_status(self.name, error, closing)
        details = details or ended
        if self.pending:
            logger.warning("%s; failing %d pending requests with %s", details, len(self.pending), code.name)
        for pending in list(self.pending.values()):
            self.fail_one(pending, rpc_error(code, details))
        current = asyncio.current_task()
        for task in (self._writer, self._reader):  # (the one calling is ending anyway)
            if task is not current:
                task.cancel()
        self.call.cancel()


class WorkerStream(Generic[Sent, Received, Pending]):
    """The multiplexed stream of one worker: opened by the first request that needs it and again after one
    broke (address: for messages only)."""

    def __init__(self, address: str, metadata: Metadata) -> None:
        self._address = address
        self._metadata = tuple(metadata)
        self._open: OpenStream[Sent, Received, Pending] | None = None
        self.closed = False

    def _connect(self) -> OpenStream[Sent, Received, Pending]:
        """Opens a new stream call (sending self._metadata)."""
        raise NotImplementedError

    def current(self) -> OpenStream[Sent, Received, Pending]:
        """The open stream, opened now if there is none (or the last one broke)."""
        if self._open is None or self._open.broken:
            self._open = self._connect()
        return self._open

    async def close(self) -> None:
        """Ends the stream (gateway shutdown): requests still pending fail CANCELLED."""
        self.closed = True
        if self._open is not None:
            self._open.fail(None, closing=True)
