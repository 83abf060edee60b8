"""The one place that maps exceptions to gRPC status, and the decorators servicers use to apply it.

The status code and message are the contract; richer google.rpc details ride along as grpc-status-details-bin
(grpcio-status): INVALID_ARGUMENT carries google.rpc.BadRequest naming the field, RESOURCE_EXHAUSTED and
UNAVAILABLE carry google.rpc.RetryInfo when retrying can succeed (docs/client.md); an error class that names its
own grpc_status (kvtransfer's, the engine's) carries google.rpc.ErrorInfo(domain=module, reason=class name), so a
client can tell apart classes that share a code (LeaseExpired and UnknownTransfer are both NOT_FOUND)."""
from __future__ import annotations

import asyncio
import contextlib
import datetime
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.protobuf.message import Message
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from rpc.logging_setup import REQUEST_ID_KEY, bind_request_id

logger = logging.getLogger(__name__)
T = TypeVar("T")
STATUS_DETAILS_KEY = "grpc-status-details-bin"


class ServiceError(Exception):
    """A failure with a known status code; the message is sent to the client as is."""

    code = grpc.StatusCode.INTERNAL


class InvalidArgument(ServiceError):
    """A request field is wrong; the message always starts with the field's name."""

    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field


def parse_field(field: str, parse: Callable[..., T], *args: object, **kwargs: object) -> T:
    """parse(*args, **kwargs), its ValueError raised again as InvalidArgument naming `field`."""
    try:
        return parse(*args, **kwargs)
    except ValueError as error:
        raise InvalidArgument(field, str(error)) from error


class NotFound(ServiceError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(ServiceError):
    code = grpc.StatusCode.ALREADY_EXISTS


class _Retryable(ServiceError):
    """retry_after_s: the delay a client should wait before retrying (sent as google.rpc.RetryInfo);
    None: retrying is not expected to help, no RetryInfo."""

    retry_after_s: float | None = 1.0

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        if retry_after_s is not None:
            self.retry_after_s = retry_after_s


class ResourceExhausted(_Retryable):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPrecondition(ServiceError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class Unavailable(_Retryable):
    code = grpc.StatusCode.UNAVAILABLE


class Aborted(ServiceError):
    code = grpc.StatusCode.ABORTED


def _named_status(error: BaseException) -> grpc.StatusCode | None:
    """The code an exception class names itself with a `grpc_status` attribute (a grpc.StatusCode name), so
    that lower floors (engine, kvtransfer) choose their status without importing grpc or this module."""
    name = getattr(type(error), "grpc_status", None)
    if not isinstance(name, str):
        return None
    return getattr(grpc.StatusCode, name, grpc.StatusCode.INTERNAL)


def status_for(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """(status code, details) for an exception raised while serving a request."""
    if isinstance(error, ServiceError):
        return error.code, str(error)
    if isinstance(error, grpc.aio.AioRpcError):  # an internal call failed: pass its status through
        return error.code(), error.details() or error.code().name
    named = _named_status(error)
    if named is not None:  # e.g. kvtransfer's errors, engine.cache.kv_cache.OutOfPages
        return named, str(error)
    if isinstance(error, (TimeoutError, asyncio.TimeoutError)):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(error) or "deadline exceeded"
    if isinstance(error, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(error)
    if isinstance(error, KeyError):
        return grpc.StatusCode.NOT_FOUND, f"not found: {error.args[0] if error.args else error}"
    if isinstance(error, NotImplementedError):
        return grpc.StatusCode.UNIMPLEMENTED, str(error)
    return grpc.StatusCode.INTERNAL, f"{type(error).__name__}: {error}"


def _details(error: BaseException) -> list[Message]:
    """The google.rpc detail messages an error carries (empty for most)."""
    if isinstance(error, InvalidArgument):
        reason = str(error).removeprefix(f"{error.field}: ")
        return [error_details_pb2.BadRequest(field_violations=[
            error_details_pb2.BadRequest.FieldViolation(field=error.field, description=reason)])]
    if isinstance(error, _Retryable) and error.retry_after_s is not None:
        delay = duration_pb2.Duration()
        delay.FromTimedelta(datetime.timedelta(seconds=error.retry_after_s))
        return [error_details_pb2.RetryInfo(retry_delay=delay)]
    if _named_status(error) is not None:  # several classes share a code (NOT_FOUND): name the exact one
        return [error_details_pb2.ErrorInfo(reason=type(error).__name__, domain=type(error).__module__)]
    return []


def error_reason(error: grpc.RpcError) -> tuple[str, str] | None:
    """(domain, reason) of the google.rpc.ErrorInfo a failed call carries (the raising exception's module
    and class name for errors that name their own grpc_status), or None."""
    try:
        status = rpc_status.from_call(error)  # type: ignore[arg-type]
    except (ValueError, AttributeError):
        return None
    for detail in status.details if status is not None else ():
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            return info.domain, info.reason
    return None


def status_of(error: BaseException) -> grpc.Status:
    """The full status for an exception: code, message and (when it has any) google.rpc details in the
    trailing metadata. A failed internal call passes its own status and details through."""
    if isinstance(error, grpc.aio.AioRpcError):
        try:
            passed = rpc_status.from_call(error)  # type: ignore[arg-type] - AioRpcError has the same accessors
        except ValueError:  # details inconsistent with the status: keep code and message only
            passed = None
        if passed is not None:
            return rpc_status.to_status(passed)
    code, message = status_for(error)
    details = _details(error)
    if not details:
        return _Status(code, message, ())
    packed = []
    for detail in details:
        item = any_pb2.Any()
        item.Pack(detail)
        packed.append(item)
    return rpc_status.to_status(status_pb2.Status(code=code.value[0], message=message, details=packed))


class _Status(grpc.Status):
    def __init__(self, code: grpc.StatusCode, details: str, trailing_metadata: tuple) -> None:
        self.code, self.details, self.trailing_metadata = code, details, trailing_metadata


def details_bin(status: grpc.Status) -> bytes:
    """The serialized google.rpc.Status a status carries as grpc-status-details-bin (empty when none): what a
    multiplexed stream sends where a unary call would end with the status."""
    return next((bytes(value) for key, value in status.trailing_metadata or () if key == STATUS_DETAILS_KEY), b"")


async def abort(context: grpc.aio.ServicerContext, status: grpc.Status) -> None:
    """Ends the RPC with `status` (raises grpc.aio.AbortError)."""
    await context.abort(status.code, status.details, status.trailing_metadata)


def failure_status(method: str, error: BaseException) -> grpc.Status:
    """status_of(error), logged once for `method` (INTERNAL with its traceback, others as one line)."""
    status = status_of(error)
    if status.code == grpc.StatusCode.INTERNAL:
        logger.exception("%s failed", method, exc_info=error)
    else:
        logger.info("%s -> %s: %s", method, status.code.name, error)
    return status


def bind_request_id_of(request: Message, context: grpc.aio.ServicerContext) -> None:
    """This RPC's log lines carry the request id: x-request-id metadata, else the message's request_id."""
    request_id = next((value for key, value in context.invocation_metadata() or () if key == REQUEST_ID_KEY), "")
    request_id = request_id or getattr(request, "request_id", "")
    if isinstance(request_id, str) and request_id:
        bind_request_id(request_id)


F = TypeVar("F", bound=Callable[..., Awaitable[Message]])


def unary(method: F) -> F:
    """Wraps an async unary servicer method: exceptions become context.abort(code, details)."""

    @functools.wraps(method)
    async def wrapper(self: object, request: Message, context: grpc.aio.ServicerContext) -> Message | None:
        bind_request_id_of(request, context)
        try:
            return await method(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as error:  # noqa: BLE001 - every failure must reach the client as a status
            await abort(context, failure_status(method.__qualname__, error))

    return wrapper  # type: ignore[return-value]


G = TypeVar("G", bound=Callable[..., AsyncIterator[Message]])


def streaming(method: G) -> G:
    """Wraps an async-generator servicer method the same way as `unary`."""

    @functools.wraps(method)
    async def wrapper(self: object, request: Message, context: grpc.aio.ServicerContext) -> AsyncIterator[Message]:
        bind_request_id_of(request, context)
        try:
            async with contextlib.aclosing(method(self, request, context)) as items:
                async for item in items:
                    yield item
        except grpc.aio.AbortError:
            raise
        except Exception as error:  # noqa: BLE001
            await abort(context, failure_status(method.__qualname__, error))

    return wrapper  # type: ignore[return-value]
