"""Prefill TP != decode TP through the services: decode ranks no prefill rank wrote get rank 0's pages copied
(prefill 1 -> decode 2), extra prefill ranks rewrite a decode rank's pool with the same replicated latent
bytes (prefill 2 -> decode 1); either way greedy outputs equal the TP=1 in-process engine's."""
from __future__ import annotations

import asyncio

import pytest

from gateway.client import build_request, generate
from tests.services.conftest import MAX_TOKENS, PROMPTS, launch, worker_address
from tests.services.helpers import at_rest, gateway_stub, idle_free_pages, wait_for_free_pages

# Prompts of 1, 16, 17, 255 and 777 tokens: one token, exactly a page, a page + 1, and multi-page ones.
CHOSEN = (0, 3, 4, 9, 12)


@pytest.fixture(scope="module", params=[(1, 2), (2, 1)], ids=["prefill1-decode2", "prefill2-decode1"])
def mixed_tp_cluster(request, service_model, tmp_path_factory):
    prefill_tp, decode_tp = request.param
    cluster = launch(service_model, tmp_path_factory.mktemp("mixed_tp_logs"), prefill_tp=prefill_tp,
                     decode_tp=decode_tp)
    yield cluster
    cluster.stop()


@pytest.mark.parametrize("speculative", [True, False], ids=["spec", "nospec"])
async def test_mixed_tp_greedy_outputs_match_in_process(mixed_tp_cluster, reference, speculative):
    """Greedy outputs (target KV and, with speculation, the draft's context) through a prefill worker and a
    decode worker of different TP sizes equal the TP=1 in-process engine's, and every page comes back."""
    decode_address = worker_address(mixed_tp_cluster, "decode-0")
    baseline = await idle_free_pages(decode_address)
    async with gateway_stub(mixed_tp_cluster.gateway_address) as stub:
        results = await asyncio.gather(*(
            generate(stub, build_request(PROMPTS[i], max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                                         speculative=None if speculative else False), timeout=300)
            for i in CHOSEN))
    assert [list(r.token_ids) for r in results] == [reference[speculative][i] for i in CHOSEN]
    load = await wait_for_free_pages(decode_address, baseline)
    assert at_rest(load, baseline), load
