"""TP=2 for both workers (12 heads per rank, the padded-head path): outputs equal the TP=1 in-process
engine's; stopping the deployment leaves no process and no shared-memory segment behind."""
from __future__ import annotations

import pytest

from tests.services.conftest import MAX_TOKENS, PROMPTS, launch
from tests.services.helpers import greedy_through_gateway
from tests.services.processes import alive, existing_segments, group_members, mapped_kv_segments


@pytest.fixture(scope="module")
def tp2_cluster(service_model, tmp_path_factory):
    cluster = launch(service_model, tmp_path_factory.mktemp("tp2_logs"), prefill_tp=2, decode_tp=2)
    yield cluster
    cluster.stop()


@pytest.mark.parametrize("speculative", [True, False], ids=["spec", "nospec"])
async def test_tp2_greedy_outputs_match_in_process(tp2_cluster, reference, speculative):
    """Greedy outputs of the 16 prompts (1..2048 tokens) through TP=2 prefill and decode workers equal
    the TP=1 in-process engine's."""
    results = await greedy_through_gateway(tp2_cluster.gateway_address, PROMPTS, MAX_TOKENS, speculative)
    assert [r.token_ids for r in results] == reference[speculative]


@pytest.mark.slow  # its own TP=2 deployment
def test_tp2_stop_leaves_no_process_and_no_segment(service_model, tmp_path):
    """After stop(): every process of every worker's group (leaders and TP followers) is gone, and so are
    the per-rank KV pool segments they had mapped. (Its own deployment: the module's stays up for others.)"""
    cluster = launch(service_model, tmp_path, prefill_tp=2, decode_tp=2)
    try:
        processes = set().union(*(group_members(child.process.pid) for child in cluster.children))
        assert len(processes) >= 5  # gateway + 2 prefill ranks + 2 decode ranks
        segments = mapped_kv_segments(processes)
        assert len(segments) >= 2  # one pool per decode rank
    finally:
        cluster.stop()
    assert not alive(processes)
    assert not existing_segments(segments)
