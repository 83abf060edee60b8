"""Server interceptors every pdserve gRPC process installs: malformed requests become INVALID_ARGUMENT,
and (when the process is given a token) calls without it become UNAUTHENTICATED.

gRPC runs a method's request deserializer before any servicer code; when protobuf refuses the bytes
(a corrupt message, invalid UTF-8 in a string field) grpc answers UNKNOWN and logs a traceback. The
interceptor swaps in a deserializer that returns a `Malformed` marker instead of raising, and wraps the
method so the marker is answered with INVALID_ARGUMENT naming the message type, without a traceback."""
from __future__ import annotations

import hmac
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import NamedTuple, Union

import grpc
from google.protobuf.message import Message

logger = logging.getLogger(__name__)
TOKEN_METADATA_KEY = "authorization"


class Malformed(NamedTuple):
    reason: str


Parsed = Union[Message, Malformed]  # what a method's deserializer gives once wrapped
# A servicer method as grpc registers it: (request or request iterator, context) -> its response (awaitable,
# or an async iterator of responses).
Behavior = Callable[..., object]


def _safe(deserializer: Callable[[bytes], Message]) -> Callable[[bytes], Parsed]:
    def parse(data: bytes) -> Parsed:
        try:
            return deserializer(data)
        except Exception as error:  # noqa: BLE001 - DecodeError and anything a custom parser raises
            return Malformed(" ".join(str(error).split()) or type(error).__name__)

    return parse


async def _refuse(context: grpc.aio.ServicerContext, method: str, malformed: Malformed) -> None:
    logger.info("%s: malformed request refused: %s", method, malformed.reason)
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request: malformed message ({malformed.reason})")


def _checked_unary(behavior: Behavior, method: str, streams: bool) -> Behavior:
    if streams and inspect.isasyncgenfunction(behavior):
        async def stream(request: Parsed, context: grpc.aio.ServicerContext) -> AsyncIterator[Message]:
            if isinstance(request, Malformed):
                await _refuse(context, method, request)
            async for item in behavior(request, context):
                yield item

        return stream

    async def unary(request: Parsed, context: grpc.aio.ServicerContext) -> object:
        if isinstance(request, Malformed):
            await _refuse(context, method, request)
        result = behavior(request, context)
        return await result if inspect.isawaitable(result) else result

    return unary


def _checked_stream(behavior: Behavior, method: str) -> Behavior:
    async def requests(iterator: AsyncIterator[Parsed], context: grpc.aio.ServicerContext) -> AsyncIterator[Message]:
        async for item in iterator:
            if isinstance(item, Malformed):
                await _refuse(context, method, item)
            yield item

    if inspect.isasyncgenfunction(behavior):
        async def stream(iterator: AsyncIterator[Parsed], context: grpc.aio.ServicerContext) -> AsyncIterator[Message]:
            async for item in behavior(requests(iterator, context), context):
                yield item

        return stream

    async def unary(iterator: AsyncIterator[Parsed], context: grpc.aio.ServicerContext) -> object:
        result = behavior(requests(iterator, context), context)
        return await result if inspect.isawaitable(result) else result

    return unary


def _wrap(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    parse, serialize = _safe(handler.request_deserializer), handler.response_serializer
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(_checked_unary(handler.unary_unary, method, False), parse, serialize)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(_checked_unary(handler.unary_stream, method, True), parse, serialize)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(_checked_stream(handler.stream_unary, method), parse, serialize)
    return grpc.stream_stream_rpc_method_handler(_checked_stream(handler.stream_stream, method), parse, serialize)


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self) -> None:
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        method = handler_call_details.method
        cached = self._wrapped.get(method)
        if cached is None or cached[0] is not handler:
            cached = self._wrapped[method] = (handler, _wrap(handler, method))
        return cached[1]


def server_interceptors(*tokens: str | None, exempt: tuple[str, ...] = ()) -> Sequence[grpc.aio.ServerInterceptor]:
    """What every pdserve server installs. tokens: calls must carry one of them (none given, or all
    None: no authentication); exempt: method-name prefixes served without a token."""
    chain: list[grpc.aio.ServerInterceptor] = []
    given = tuple(token for token in tokens if token)
    if given:
        chain.append(TokenAuthInterceptor(*given, exempt=exempt))
    chain.append(MalformedRequestInterceptor())
    return chain


def token_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata that carries token (empty without one)."""
    return ((TOKEN_METADATA_KEY, f"Bearer {token}"),) if token else ()


def read_token_file(path: str | None) -> str | None:
    """The token kept in a file (first line, stripped); None without a path. An empty file is an error."""
    if not path:
        return None
    with open(path, encoding="utf-8") as handle:
        token = handle.readline().strip()
    if not token:
        raise ValueError(f"token file {path} is empty")
    return token


def read_key_file(path: str) -> tuple[str, ...]:
    """API keys, one per line (blank lines and # comments ignored)."""
    with open(path, encoding="utf-8") as handle:
        keys = tuple(line.strip() for line in handle if line.strip() and not line.lstrip().startswith("#"))
    if not keys:
        raise ValueError(f"key file {path} holds no key")
    return keys


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Every call must carry `authorization: Bearer <token>` (one of `tokens`), compared in constant
    time; others end UNAUTHENTICATED before their request is read. exempt: method-name prefixes that
    need no token (e.g. "/grpc.health.v1.Health/" for load-balancer probes)."""

    def __init__(self, *tokens: str, exempt: tuple[str, ...] = ()) -> None:
        if not tokens or not all(tokens):
            raise ValueError("TokenAuthInterceptor needs at least one non-empty token")
        self._expected = [f"Bearer {token}".encode() for token in tokens]
        self._exempt = tuple(exempt)

    def _allowed(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> bool:
        for key, value in metadata or ():
            if key == TOKEN_METADATA_KEY:
                given = value.encode() if isinstance(value, str) else bytes(value)
                return any(hmac.compare_digest(given, expected) for expected in self._expected)
        return False

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if handler_call_details.method.startswith(self._exempt) and self._exempt:
            return await continuation(handler_call_details)
        if self._allowed(handler_call_details.invocation_metadata):
            return await continuation(handler_call_details)
        logger.info("%s: call without a valid token refused", handler_call_details.method)
        return _unauthenticated(await continuation(handler_call_details))


def _unauthenticated(handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler | None:
    if handler is None:
        return None
    message = "missing or invalid bearer token (metadata 'authorization: Bearer <token>')"

    async def refuse(request: object, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    ignore = lambda data: None  # noqa: E731 - the request is never parsed
    if handler.unary_unary is not None or handler.stream_unary is not None:
        maker = grpc.unary_unary_rpc_method_handler if handler.unary_unary is not None else grpc.stream_unary_rpc_method_handler
        return maker(refuse, ignore, handler.response_serializer)
    maker = grpc.unary_stream_rpc_method_handler if handler.unary_stream is not None else grpc.stream_stream_rpc_method_handler
    return maker(refuse, ignore, handler.response_serializer)
