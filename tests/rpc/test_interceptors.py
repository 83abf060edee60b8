"""The server interceptors over a real in-process grpc.aio server (health + reflection, port 0):
malformed requests end INVALID_ARGUMENT without a traceback, and a server given a token refuses calls
that do not carry it."""
from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rpc import server as serving
from rpc.interceptors import TokenAuthInterceptor, server_interceptors

CHECK = "/grpc.health.v1.Health/Check"
WATCH = "/grpc.health.v1.Health/Watch"
REFLECTION = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"
INVALID_UTF8 = b"\x0a\x02\xff\xfe"  # field 1 (service, a string) holding bytes that are not UTF-8
TRUNCATED = b"\x0a\x05ab"           # a length-delimited field cut short


@asynccontextmanager
async def _server(token: str | None = None) -> AsyncIterator[str]:
    server = grpc.aio.server(interceptors=server_interceptors(token))
    health = serving.add_health_and_reflection(server, ["test.Service"])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await serving.set_serving(health, ["test.Service"], True)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


@pytest.mark.parametrize("payload", [INVALID_UTF8, TRUNCATED], ids=["invalid-utf8", "truncated"])
async def test_malformed_unary_and_streaming_requests_are_invalid_argument(payload, caplog):
    """A unary, a server-streaming and a bidi-streaming method each answer INVALID_ARGUMENT to bytes
    protobuf cannot parse, and nothing is logged at ERROR (no traceback)."""
    caplog.set_level(logging.INFO)
    async with _server() as address, grpc.aio.insecure_channel(address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as unary:
            await channel.unary_unary(CHECK)(payload, timeout=10)
        with pytest.raises(grpc.aio.AioRpcError) as stream:
            async for _ in channel.unary_stream(WATCH)(payload, timeout=10):
                pass
        with pytest.raises(grpc.aio.AioRpcError) as bidi:
            async for _ in channel.stream_stream(REFLECTION)(iter([payload]), timeout=10):
                pass
        good = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    for caught in (unary, stream, bidi):
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value
        assert caught.value.details().startswith("request: malformed message"), caught.value.details()
    assert good.status == health_pb2.HealthCheckResponse.SERVING
    assert not [record for record in caplog.records if record.levelno >= logging.ERROR or record.exc_info]


async def test_token_is_required_when_configured():
    """With a token, calls without it, or with a wrong one, end UNAUTHENTICATED (unary and streaming);
    the right one is served."""
    async with _server(token="s3cret") as address, grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for metadata in ((), (("authorization", "Bearer wrong"),), (("authorization", "s3cret"),)):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.Check(health_pb2.HealthCheckRequest(), metadata=metadata, timeout=10)
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED, metadata
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                async for _ in stub.Watch(health_pb2.HealthCheckRequest(), metadata=metadata, timeout=10):
                    pass
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED, metadata
        reply = await stub.Check(health_pb2.HealthCheckRequest(), metadata=(("authorization", "Bearer s3cret"),),
                                 timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_token_interceptor_refuses_empty_tokens():
    """An empty token would let every call through: refused at construction."""
    with pytest.raises(ValueError):
        TokenAuthInterceptor("")
