"""The one place that maps exceptions to gRPC status codes, and the decorators servicers use to apply it."""
from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc

from pdserve.logging_setup import REQUEST_ID_KEY, bind_request_id

logger = logging.getLogger(__name__)


class ServiceError(Exception):
    """A failure with a known status code; the message is sent to the client as is."""

    code = grpc.StatusCode.INTERNAL


class InvalidArgument(ServiceError):
    """A request field is wrong; the message always starts with the field's name."""

    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field


class NotFound(ServiceError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(ServiceError):
    code = grpc.StatusCode.ALREADY_EXISTS


class ResourceExhausted(ServiceError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPrecondition(ServiceError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class Unavailable(ServiceError):
    code = grpc.StatusCode.UNAVAILABLE


class Aborted(ServiceError):
    code = grpc.StatusCode.ABORTED


# Exceptions of modules the gateway must not import (they pull in torch), matched only when loaded.
_LAZY_TYPES: tuple[tuple[str, str, grpc.StatusCode], ...] = (
    ("engine.kv_cache", "OutOfPages", grpc.StatusCode.RESOURCE_EXHAUSTED),
)


def status_for(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """(status code, details) for an exception raised while serving a request."""
    if isinstance(error, ServiceError):
        return error.code, str(error)
    if isinstance(error, grpc.aio.AioRpcError):  # an internal call failed: pass its status through
        return error.code(), error.details() or error.code().name
    kv_errors = sys.modules.get("kvtransfer.errors")
    if kv_errors is not None and isinstance(error, kv_errors.KVTransferError):  # each names its own status
        return getattr(grpc.StatusCode, getattr(error, "status", "INTERNAL"), grpc.StatusCode.INTERNAL), str(error)
    for module_name, type_name, code in _LAZY_TYPES:
        module = sys.modules.get(module_name)
        error_type = getattr(module, type_name, None) if module is not None else None
        if error_type is not None and isinstance(error, error_type):
            return code, str(error)
    if isinstance(error, (TimeoutError, asyncio.TimeoutError)):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(error) or "deadline exceeded"
    if isinstance(error, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(error)
    if isinstance(error, KeyError):
        return grpc.StatusCode.NOT_FOUND, f"not found: {error.args[0] if error.args else error}"
    if isinstance(error, NotImplementedError):
        return grpc.StatusCode.UNIMPLEMENTED, str(error)
    return grpc.StatusCode.INTERNAL, f"{type(error).__name__}: {error}"


def _log(method: str, error: BaseException, code: grpc.StatusCode) -> None:
    if code == grpc.StatusCode.INTERNAL:
        logger.exception("%s failed", method, exc_info=error)
    else:
        logger.info("%s -> %s: %s", method, code.name, error)


def bind_request_id_of(request: Any, context: grpc.aio.ServicerContext) -> None:
    """This RPC's log lines carry the request id: x-request-id metadata, else the message's request_id."""
    request_id = next((value for key, value in context.invocation_metadata() or () if key == REQUEST_ID_KEY), "")
    request_id = request_id or getattr(request, "request_id", "")
    if isinstance(request_id, str) and request_id:
        bind_request_id(request_id)


F = TypeVar("F", bound=Callable[..., Awaitable[Any]])


def unary(method: F) -> F:
    """Wraps an async unary servicer method: exceptions become context.abort(code, details)."""

    @functools.wraps(method)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        bind_request_id_of(request, context)
        try:
            return await method(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as error:  # noqa: BLE001 - every failure must reach the client as a status
            code, details = status_for(error)
            _log(method.__qualname__, error, code)
            await context.abort(code, details)

    return wrapper  # type: ignore[return-value]


G = TypeVar("G", bound=Callable[..., AsyncIterator[Any]])


def streaming(method: G) -> G:
    """Wraps an async-generator servicer method the same way as `unary`."""

    @functools.wraps(method)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        bind_request_id_of(request, context)
        try:
            async with contextlib.aclosing(method(self, request, context)) as items:
                async for item in items:
                    yield item
        except grpc.aio.AbortError:
            raise
        except Exception as error:  # noqa: BLE001
            code, details = status_for(error)
            _log(method.__qualname__, error, code)
            await context.abort(code, details)

    return wrapper  # type: ignore[return-value]
