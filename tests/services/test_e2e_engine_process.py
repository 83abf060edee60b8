"""A deployment whose decode worker runs its engine in a process of its own (--engine-process), at decode
TP=2 (the followers spawn from the engine process): greedy outputs through the gateway equal the TP=1
in-process engine's, speculation on and off; stopping it leaves no process and no segment behind."""
from __future__ import annotations

import asyncio

import pytest

from gateway.client import build_request, generate
from tests.services.conftest import MAX_TOKENS, PROMPTS, launch
from tests.services.helpers import gateway_stub, idle_free_pages
from tests.services.processes import alive, descendants, existing_segments, group_members, mapped_kv_segments

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine_process_cluster(service_model, tmp_path_factory):
    cluster = launch(service_model, tmp_path_factory.mktemp("engine_process_logs"), decode_tp=2,
                     decode_args=("--engine-process",))
    yield cluster
    cluster.stop()


@pytest.mark.parametrize("speculative", [True, False], ids=["spec", "nospec"])
async def test_engine_process_outputs_match_in_process(engine_process_cluster, reference, speculative):
    """The 16 prompts (1..2048 tokens), sent concurrently, come back token-identical to LLM.generate, and the
    decode worker's pages are all free again afterwards."""
    decode = next(child for child in engine_process_cluster.children if child.role.startswith("decode"))
    async with gateway_stub(engine_process_cluster.gateway_address) as stub:
        results = await asyncio.gather(*(
            generate(stub, build_request(prompt, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                                         speculative=None if speculative else False), timeout=300)
            for prompt in PROMPTS))
    assert [r.token_ids for r in results] == reference[speculative]
    assert await idle_free_pages(decode.address) > 0


def test_engine_process_stop_leaves_nothing(engine_process_cluster):
    """The decode worker has its engine process and a TP follower below it, mapping the per-rank pools; after
    stop() every one of those processes is gone and so are the segments."""
    decode = next(child for child in engine_process_cluster.children if child.role.startswith("decode"))
    below = descendants(decode.process.pid)
    assert len(below) >= 2  # the engine process and its TP follower (rank 1)
    processes = set().union(*(group_members(child.process.pid) for child in engine_process_cluster.children))
    segments = mapped_kv_segments(processes)
    assert len(segments) >= 2
    engine_process_cluster.stop()
    assert not alive(processes | below)
    assert not existing_segments(segments)


async def test_engine_process_serves_the_device_transport(service_model, reference, tmp_path):
    """With the decode pool a device pool (the memfd IPC stand-in on the CPU) created by the engine process,
    the worker attaches it by name and prefill writes into it: greedy outputs equal the in-process engine's."""
    cluster = launch(service_model, tmp_path, transport="device", decode_args=("--engine-process",))
    try:
        async with gateway_stub(cluster.gateway_address) as stub:
            results = await asyncio.gather(*(
                generate(stub, build_request(prompt, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                                             speculative=False), timeout=300)
                for prompt in PROMPTS[:6]))
        assert [r.token_ids for r in results] == reference[False][:6]
        assert "device handoff" in "".join(log.read_text() for log in tmp_path.glob("prefill*.log"))
    finally:
        cluster.stop()
