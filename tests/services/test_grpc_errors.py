"""The one exception -> status mapping, and the servicer decorators that apply it."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from kvtransfer.errors import ChecksumMismatch, LayoutMismatch, LeaseExpired
from pdserve.grpc_errors import InvalidArgument, NotFound, ResourceExhausted, status_for, streaming, unary
from pdserve.v1 import gateway_pb2


@pytest.mark.parametrize("error,code", [
    (InvalidArgument("max_tokens", "must be positive"), grpc.StatusCode.INVALID_ARGUMENT),
    (NotFound("x"), grpc.StatusCode.NOT_FOUND),
    (ResourceExhausted("full"), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (ValueError("bad"), grpc.StatusCode.INVALID_ARGUMENT),
    (KeyError("k"), grpc.StatusCode.NOT_FOUND),
    (asyncio.TimeoutError(), grpc.StatusCode.DEADLINE_EXCEEDED),
    (ChecksumMismatch("pages"), grpc.StatusCode.DATA_LOSS),
    (LayoutMismatch("hash"), grpc.StatusCode.FAILED_PRECONDITION),
    (LeaseExpired("late"), grpc.StatusCode.NOT_FOUND),
    (RuntimeError("boom"), grpc.StatusCode.INTERNAL),
])
def test_status_for(error, code):
    """Each exception family maps to its status; the details keep the message."""
    mapped, details = status_for(error)
    assert mapped == code
    assert details


def test_out_of_pages_is_resource_exhausted():
    """The engine's OutOfPages (matched lazily, without importing torch in the gateway) is RESOURCE_EXHAUSTED."""
    from engine.kv_cache import OutOfPages

    assert status_for(OutOfPages("need 3"))[0] == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_invalid_argument_message_starts_with_field():
    """InvalidArgument's text is '<field>: <reason>' and keeps the field."""
    error = InvalidArgument("sampling.top_p", "must be in (0, 1]")
    assert str(error) == "sampling.top_p: must be in (0, 1]" and error.field == "sampling.top_p"


class _Context:
    def __init__(self) -> None:
        self.aborted: tuple[grpc.StatusCode, str] | None = None

    async def abort(self, code, details):
        self.aborted = (code, details)
        raise grpc.aio.AbortError()

    def invocation_metadata(self):
        return ()


class _Servicer:
    @unary
    async def Fail(self, request, context):
        raise InvalidArgument("input", "is empty")

    @streaming
    async def Stream(self, request, context):
        yield gateway_pb2.GenerateResponse(request_id="a")
        raise ResourceExhausted("no room")


async def test_decorators_abort_with_the_mapped_status():
    """A raising unary method and a generator failing mid-stream both end in context.abort(code, details)."""
    context = _Context()
    with pytest.raises(grpc.aio.AbortError):
        await _Servicer().Fail(None, context)
    assert context.aborted == (grpc.StatusCode.INVALID_ARGUMENT, "input: is empty")
    context, received = _Context(), []
    with pytest.raises(grpc.aio.AbortError):
        async for item in _Servicer().Stream(None, context):
            received.append(item.request_id)
    assert received == ["a"] and context.aborted == (grpc.StatusCode.RESOURCE_EXHAUSTED, "no room")
