"""Errors on the public API before anything is streamed (issue 15, item 5), on the shared deployment:
malformed messages, an oversized block_size, Abort without an id, and reusing a finished request's id."""
from __future__ import annotations

import grpc
import pytest

from gateway.client import build_request, generate
from rpc.v1 import gateway_pb2
from tests.services.helpers import gateway_stub

pytestmark = pytest.mark.slow
GENERATE = "/pdserve.v1.GatewayService/Generate"
ABORT = "/pdserve.v1.GatewayService/Abort"


@pytest.mark.parametrize("method,payload", [
    (GENERATE, b"\x0a\x02\xff\xfe"),    # request_id (string) with bytes that are not UTF-8
    (GENERATE, b"\x12\x09abc"),         # text cut short
    (ABORT, b"\x0a\x03\xc3\x28x"),      # invalid UTF-8 in AbortRequest.request_id
], ids=["generate-utf8", "generate-truncated", "abort-utf8"])
async def test_malformed_messages_are_invalid_argument(cluster, method, payload):
    """Bytes protobuf cannot parse end INVALID_ARGUMENT (not UNKNOWN), streaming nothing."""
    async with grpc.aio.insecure_channel(cluster.gateway_address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            if method == GENERATE:
                async for response in channel.unary_stream(method)(payload, timeout=30):
                    pytest.fail(f"streamed {response!r}")
            else:
                await channel.unary_unary(method)(payload, timeout=30)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value
    assert "malformed message" in caught.value.details()


async def test_oversized_block_size_is_refused_before_any_chunk(cluster):
    """block_size 1000 (the workers allow 8) ends INVALID_ARGUMENT naming block_size, and no token or
    chunk is streamed before the error."""
    async with gateway_stub(cluster.gateway_address) as stub:
        result = await generate(stub, build_request([5, 6, 7], max_tokens=8, block_size=1000, speculative=True),
                                timeout=60)
    assert result.error is not None and result.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0], result
    assert result.error.message.startswith("block_size"), result.error.message
    assert result.token_ids == [] and result.deltas == []


async def test_abort_with_empty_id_is_refused(cluster):
    """Abort needs the id of the request to abort: an empty one is INVALID_ARGUMENT naming request_id."""
    async with gateway_stub(cluster.gateway_address) as stub:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.Abort(gateway_pb2.AbortRequest(), timeout=30)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith("request_id")


async def test_request_id_is_reusable_as_soon_as_complete_arrives(cluster):
    """A request_id sent again the moment its Complete message arrives is accepted every time (20 in a
    row, alternating a request that finishes in prefill and one that decodes)."""
    async with gateway_stub(cluster.gateway_address) as stub:
        for attempt in range(20):
            request = build_request([5, 6, 7, 8], max_tokens=1 + attempt % 2 * 3, temperature=0.0, ignore_eos=True,
                                    request_id="reused-id")
            result = await generate(stub, request, timeout=60)
            assert result.error is None and result.complete is not None, (attempt, result.error)
            assert result.request_id == "reused-id"
