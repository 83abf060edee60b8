"""DecodeStream through real processes (issue 18, item 2): the session deployment's gateway runs its decodes over
one DecodeStream per decode worker (the one way). Greedy outputs are the in-process engine's, with speculation and
without, with decode step counts that account for every token; a client that goes away mid-decode, beside others
sharing the stream, is aborted alone and leaves no page or lease. (A decode worker killed mid-stream:
tests/services/test_supervision.py.)"""
from __future__ import annotations

import asyncio

import grpc
import pytest

from gateway.client import build_request, generate
from tests.services.conftest import MAX_TOKENS, PROMPTS, worker_address
from tests.services.helpers import (at_rest, decode_load, gateway_stub, greedy, greedy_through_gateway,
                                    idle_free_pages, token_prompts, wait_for_free_pages)

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("speculative", [True, False], ids=["spec", "nospec"])
async def test_greedy_outputs_over_the_decode_stream(cluster, reference, speculative):
    """The 16 prompts of 1..2048 tokens, sent at once through the gateway, come back token-identical to the
    in-process engine's, with LENGTH finishes and decode step counts that account for every token."""
    results = await greedy_through_gateway(cluster.gateway_address, PROMPTS, MAX_TOKENS, speculative)
    assert [r.token_ids for r in results] == reference[speculative]
    for result in results:
        assert result.error is None and result.finish_reason == "LENGTH"
        acceptance = result.complete.acceptance
        assert acceptance.verify_steps * acceptance.mean_accepted_tokens == pytest.approx(MAX_TOKENS - 1)


async def test_a_client_gone_mid_decode_is_aborted_alone_and_frees_its_pages(cluster, llm):
    """Four requests decode on the gateway's one stream; the client of one leaves after a few tokens: the other
    three finish with their solo greedy tokens, and the decode worker comes back to its idle baseline (nothing
    running, only the gateway's spare leased)."""
    decode = worker_address(cluster, "decode-0")
    baseline = await idle_free_pages(decode)
    kept_prompts = token_prompts((40, 90, 150), seed=31)
    expected = [llm.generate([prompt], greedy(48))[0] for prompt in kept_prompts]
    async with gateway_stub(cluster.gateway_address) as stub:
        kept = [asyncio.ensure_future(generate(stub, build_request(prompt, max_tokens=48, temperature=0.0,
                                                                   ignore_eos=True), timeout=300))
                for prompt in kept_prompts]
        leaving = stub.Generate(build_request(token_prompts((120,), seed=32)[0], max_tokens=2000, temperature=0.0,
                                              ignore_eos=True), timeout=300)
        received = 0
        async for response in leaving:
            received += len(response.chunk.token_ids)
            if received >= 5:
                break
        assert (await decode_load(decode)).running >= 1
        leaving.cancel()
        assert await leaving.code() == grpc.StatusCode.CANCELLED
        results = await asyncio.gather(*kept)
    assert [result.token_ids for result in results] == expected
    assert all(result.finish_reason == "LENGTH" for result in results)
    load = await wait_for_free_pages(decode, baseline)
    assert at_rest(load, baseline), load
