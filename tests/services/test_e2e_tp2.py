"""TP=2 for both workers (12 heads per rank, the padded-head path), the decode engine and its follower in the
decode worker's engine process: outputs equal the TP=1 in-process engine's; stopping the deployment leaves no
process and no shared-memory segment behind."""
from __future__ import annotations

import asyncio

import pytest

from tests.services.conftest import MAX_TOKENS, PROMPTS, launch
from tests.services.helpers import at_rest, greedy_through_gateway, idle_free_pages, wait_for_free_pages
from tests.services.processes import alive, existing_segments, group_members, mapped_kv_segments

pytestmark = pytest.mark.slow  # a TP=2 deployment of its own (5 processes)


async def test_tp2_outputs_match_in_process_and_stop_leaves_nothing(service_model, reference, tmp_path):
    """Greedy outputs of the 16 prompts (1..2048 tokens, sent concurrently) through TP=2 prefill and decode
    workers equal the TP=1 in-process engine's, with speculation and without; the decode worker's engine runs
    in its engine process (its log lines say decode-engine) and its pages are free again afterwards. After stop(): every process of every worker's
    group (leaders and TP followers) is gone, and so are the per-rank KV pool segments they had mapped.
    (One deployment for all of it: the test owns it from launch to stop.)"""
    cluster = await asyncio.to_thread(launch, service_model, tmp_path, prefill_tp=2, decode_tp=2)
    try:
        processes = set().union(*(group_members(child.process.pid) for child in cluster.children))
        assert len(processes) >= 6  # gateway + 2 prefill ranks + the decode worker + its engine's 2 ranks
        segments = mapped_kv_segments(processes)
        assert len(segments) >= 2  # one pool per decode rank
        decode = next(child for child in cluster.children if child.role.startswith("decode"))
        log = (tmp_path / "decode-0.log").read_text()  # the engine process logs as decode-engine[rank]
        assert "decode-engine[" in log, log[-2000:]
        baseline = await idle_free_pages(decode.address)
        for speculative in (True, False):
            results = await greedy_through_gateway(cluster.gateway_address, PROMPTS, MAX_TOKENS, speculative)
            assert [r.token_ids for r in results] == reference[speculative], f"speculative={speculative}"
        load = await wait_for_free_pages(decode.address, baseline)
        assert at_rest(load, baseline), load
    finally:
        await asyncio.to_thread(cluster.stop)
    assert not alive(processes)
    assert not existing_segments(segments)
