"""The one exception -> status mapping, and the servicer decorators that apply it."""
from __future__ import annotations

import asyncio

import grpc
from google.rpc import error_details_pb2, status_pb2
import pytest

from kvtransfer.errors import ChecksumMismatch, LayoutMismatch, LeaseExpired
from rpc.status import InvalidArgument, NotFound, ResourceExhausted, Unavailable, status_for, status_of, streaming, unary
from rpc.v1 import gateway_pb2


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
    from engine.cache.kv_cache import OutOfPages

    assert status_for(OutOfPages("need 3"))[0] == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_invalid_argument_message_starts_with_field():
    """InvalidArgument's text is '<field>: <reason>' and keeps the field."""
    error = InvalidArgument("sampling.top_p", "must be in (0, 1]")
    assert str(error) == "sampling.top_p: must be in (0, 1]" and error.field == "sampling.top_p"


class _Context:
    def __init__(self) -> None:
        self.aborted: tuple[grpc.StatusCode, str] | None = None

    async def abort(self, code, details, trailing_metadata=()):
        self.aborted = (code, details)
        self.trailing_metadata = trailing_metadata
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


def _rich(status: grpc.Status) -> status_pb2.Status:
    [(key, value)] = status.trailing_metadata
    assert key == "grpc-status-details-bin"
    rich = status_pb2.Status.FromString(value)
    assert (rich.code, rich.message) == (status.code.value[0], status.details)
    return rich


def test_invalid_argument_carries_bad_request_with_the_field():
    """INVALID_ARGUMENT from InvalidArgument packs google.rpc.BadRequest(field, description); message kept."""
    status = status_of(InvalidArgument("sampling.top_p", "must be in (0, 1], got 1.5"))
    assert (status.code, status.details) == (grpc.StatusCode.INVALID_ARGUMENT, "sampling.top_p: must be in (0, 1], got 1.5")
    [detail] = _rich(status).details
    bad = error_details_pb2.BadRequest()
    assert detail.Unpack(bad)
    assert [(v.field, v.description) for v in bad.field_violations] == [("sampling.top_p", "must be in (0, 1], got 1.5")]


@pytest.mark.parametrize("error,seconds", [
    (ResourceExhausted("no decode worker has room"), 1.0),
    (Unavailable("no reachable prefill worker", retry_after_s=0.25), 0.25),
])
def test_retryable_errors_carry_retry_info(error, seconds):
    """RESOURCE_EXHAUSTED and UNAVAILABLE pack google.rpc.RetryInfo with the suggested delay."""
    [detail] = _rich(status_of(error)).details
    info = error_details_pb2.RetryInfo()
    assert detail.Unpack(info)
    assert info.retry_delay.ToTimedelta().total_seconds() == seconds


def test_plain_errors_have_no_details():
    """A status without details sends no grpc-status-details-bin trailer (code and message only)."""
    status = status_of(NotFound("gone"))
    assert (status.code, status.details, tuple(status.trailing_metadata)) == (grpc.StatusCode.NOT_FOUND, "gone", ())


def test_self_named_errors_carry_their_class_in_error_info():
    """An error naming its own grpc_status (LeaseExpired and UnknownTransfer share NOT_FOUND) carries
    google.rpc.ErrorInfo(domain=its module, reason=its class), so a client can tell which one it was."""
    status = status_of(LeaseExpired("late"))
    assert (status.code, status.details) == (grpc.StatusCode.NOT_FOUND, "late")
    info = error_details_pb2.ErrorInfo()
    [detail] = _rich(status).details
    assert detail.Unpack(info) and (info.domain, info.reason) == ("kvtransfer.errors", "LeaseExpired")


async def test_decorator_sends_the_details_as_trailing_metadata():
    """The unary decorator passes the rich status's trailing metadata to context.abort."""
    context = _Context()
    with pytest.raises(grpc.aio.AbortError):
        await _Servicer().Fail(None, context)
    bad = error_details_pb2.BadRequest()
    [detail] = _rich(_Fake(context)).details
    assert detail.Unpack(bad) and bad.field_violations[0].field == "input"


class _Fake(grpc.Status):
    def __init__(self, context: _Context) -> None:
        self.code, self.details = context.aborted
        self.trailing_metadata = context.trailing_metadata
