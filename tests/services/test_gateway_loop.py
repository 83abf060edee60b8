"""The gateway's event loop stays free under huge and long prompts (issue 15, item 4), on the shared
deployment: a prompt over the size limit is refused before it is parsed or tokenised, and a long one
under the limit is tokenised in a pool process while other requests go on."""
from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from gateway.client import build_request, generate
from tests.services.helpers import gateway_stub

pytestmark = pytest.mark.slow
SMALL = build_request([5, 6, 7, 8], max_tokens=2, temperature=0.0, ignore_eos=True)
# Python source-like text: ~2.4 bytes per token with the test tokenizer, so ~400k tokens (100x the
# model's context): tokenising it takes seconds, and it is then refused for its length.
LONG_TEXT = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n" * 12_000


async def _timed_small(stub) -> float:
    started = time.perf_counter()
    result = await generate(stub, SMALL, timeout=60)
    assert result.complete is not None, result.error
    return time.perf_counter() - started


async def test_16mb_prompt_is_refused_by_the_transport_and_delays_nobody(cluster):
    """A 16 MB text prompt is refused by the transport (RESOURCE_EXHAUSTED, over the 4 MiB request limit), in gRPC's
    core before the servicer sees it: never parsed or tokenised, so no request is counted for it; a small request
    sent right after it completes. (No wall-clock bound: the stall this guards against - the message parsed and
    tokenised on the event loop, ~16 s - shows as a counted request, and the long-text test below checks order.)"""
    async with gateway_stub(cluster.gateway_address) as stub:
        await _timed_small(stub)
        before = _requests_counted(cluster)
        huge_request = build_request("a" * 16 * 2**20, max_tokens=4)
        huge_sent = asyncio.Event()

        async def huge() -> None:
            huge_sent.set()  # (then, without yielding, its call goes out)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await generate(stub, huge_request, timeout=60)
            assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, caught.value
            assert "larger than max" in caught.value.details(), caught.value.details()

        async def small_after_huge() -> None:
            await huge_sent.wait()  # the huge request goes out first
            await _timed_small(stub)

        await asyncio.gather(huge(), small_after_huge())
    assert _requests_counted(cluster) == before + 1  # the small one only


def _requests_counted(cluster) -> int:
    """Requests the gateway's servicer took in, from its log: one "finished" or failure line each."""
    text = (cluster.log_dir / "gateway.log").read_text()
    return text.count("finished (")


async def test_long_text_is_tokenised_off_the_event_loop(cluster):
    """A ~1 MB text under the size limit is tokenised in the pool (seconds of work), then refused with
    INVALID_ARGUMENT naming input (longer than the context); small requests sent meanwhile all
    complete before that refusal arrives (with tokenisation on the loop they would wait behind it)."""
    order: list[str] = []
    async with gateway_stub(cluster.gateway_address) as stub:
        long_sent = asyncio.Event()

        async def long() -> None:
            long_sent.set()  # (then, without yielding, its call goes out)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await generate(stub, build_request(LONG_TEXT, max_tokens=4), timeout=120)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value
            assert caught.value.details().startswith("input"), caught.value.details()
            order.append("long refused")

        async def smalls() -> None:
            await long_sent.wait()  # the long text goes out first
            for _ in range(3):
                await _timed_small(stub)
            order.append("small done")

        await asyncio.gather(long(), smalls())
    assert order == ["small done", "long refused"], order
