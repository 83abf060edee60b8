"""What the gateway's long-lived, multiplexed worker streams share (prefill_stream.py, decode_stream.py): the
errors their requests fail with, shaped as the unary calls' would be, and the end of a stream."""
from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import grpc

from rpc.status import STATUS_DETAILS_KEY

# The local deadline fires this much after the request's: the worker's own DEADLINE_EXCEEDED answer (and the
# gateway's incoming call, whose deadline this is) end the request first, as they do a unary call; the local
# timer only covers a worker that never answers.
LOCAL_DEADLINE_GRACE_S = 0.1
Metadata = Sequence[tuple[str, Any]]


def rpc_error(code: grpc.StatusCode, details: str, status_details: bytes = b"") -> grpc.aio.AioRpcError:
    """The error a unary call ending with (code, details) raises; status_details: its google.rpc.Status."""
    trailing = grpc.aio.Metadata((STATUS_DETAILS_KEY, status_details)) if status_details else grpc.aio.Metadata()
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, details)


def code_of(value: int) -> grpc.StatusCode:
    """The grpc.StatusCode of a status carried as its number (UNKNOWN for a number that names none)."""
    return next((code for code in grpc.StatusCode if code.value[0] == value), grpc.StatusCode.UNKNOWN)


def ended_status(name: str, error: BaseException | None, closing: bool) -> tuple[grpc.StatusCode, str]:
    """(code, details) for the requests pending on a stream (`name`: e.g. "prefill stream to host:port") that
    is over: UNAVAILABLE, unless the worker refused the stream itself with another code, or the gateway is
    closing (CANCELLED)."""
    if closing:
        return grpc.StatusCode.CANCELLED, "the gateway is shutting down"
    if not isinstance(error, grpc.aio.AioRpcError):
        return grpc.StatusCode.UNAVAILABLE, f"{name} ended"
    details = f"{name} broke: {error.code().name} {error.details()}"
    if error.code() in (grpc.StatusCode.OK, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN):
        return grpc.StatusCode.UNAVAILABLE, details
    return error.code(), details


def stop_tasks(*tasks: asyncio.Task[Any]) -> None:
    """Cancels a stream's writer and reader tasks, but the one calling (it is ending anyway)."""
    current = asyncio.current_task()
    for task in tasks:
        if task is not current:
            task.cancel()
