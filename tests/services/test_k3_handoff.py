"""Kimi K3 served by gateway + prefill + decode workers (issue 14 items 3 and 5): speculation on (DSpark
draft), TP=2 on both workers, shm and grpc transports; the KDA state travels with the latent pages. Greedy
outputs of 16 prompts equal the in-process engine's; afterwards every page and state slot on decode is
free and no shared-memory segment is left."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from gateway.client import build_request, generate
from pdserve.launcher import Cluster
from tests.services.conftest import launch, worker_address
from tests.services.helpers import decode_load, gateway_stub, greedy, token_prompts, unspared_free_pages
from tests.services.k3_service_model import make_k3_service_model
from tests.services.processes import existing_segments, group_members, mapped_kv_segments

pytestmark = pytest.mark.slow
MAX_TOKENS = 12
PROMPTS = token_prompts((1, 2, 5, 7, 15, 16, 17, 31, 33, 48, 64, 90, 128, 160, 200, 257), seed=14)


@pytest.fixture(scope="module")
def k3_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_k3_service_model(tmp_path_factory.mktemp("k3_service_model"))


@pytest.fixture(scope="module")
def k3_reference(k3_model: Path) -> list[list[int]]:
    """In-process greedy outputs (LLM, TP=1, speculation on with the DSpark draft)."""
    from engine import LLM

    with LLM(str(k3_model), attention_backend="torch", kv_memory_bytes=32 * 2**20, num_threads=1) as llm:
        assert llm.engine.has_draft and llm.engine.state_pool is not None
        return llm.generate(PROMPTS, greedy(MAX_TOKENS, None))


async def _idle(address: str, spares: int, timeout: float = 60.0):
    """The decode worker's load once nothing runs, nothing waits and the only leases held are the gateway's
    `spares` spares (standing leases: shm only), every state slot free but theirs."""
    deadline = time.monotonic() + timeout
    while True:
        load = await decode_load(address)
        if ((load.running, load.waiting, load.leases, load.standing_leases) == (0, 0, spares, spares)
                and load.free_state_slots + load.standing_state_slots == load.total_state_slots):
            return load
        assert time.monotonic() < deadline, f"decode worker never went idle: {load}"
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("transport", ["shm", "grpc"])
async def test_k3_gateway_outputs_equal_in_process_and_free_everything(k3_model, k3_reference, transport, tmp_path):
    """Through the gateway (TP=2 prefill and decode, spec on, KDA state handed over by `transport`) the
    greedy outputs of 16 prompts equal the in-process engine's; afterwards decode has every page and every
    state slot free, and stopping the deployment leaves none of its /dev/shm segments behind."""
    cluster: Cluster = await asyncio.to_thread(launch, k3_model, tmp_path, prefill_tp=2, decode_tp=2, transport=transport)
    try:
        processes = set().union(*(group_members(child.process.pid) for child in cluster.children))
        segments = mapped_kv_segments(processes)
        assert len(segments) >= 2  # one pool (pages + state slots) per decode rank
        decode = worker_address(cluster, "decode-0")
        spares = int(transport == "shm")
        idle = await _idle(decode, spares)
        assert idle.total_state_slots > 0 and idle.placement.tp_size == 2
        assert idle.standing_state_slots == spares  # a spare holds a state slot too
        async with gateway_stub(cluster.gateway_address) as stub:
            results = await asyncio.gather(*(
                generate(stub, build_request(prompt, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                                             speculative=True), timeout=600)
                for prompt in PROMPTS))
        assert [r.token_ids for r in results] == k3_reference
        async with gateway_stub(cluster.gateway_address) as stub:  # a client that leaves mid-decode
            call = stub.Generate(build_request(PROMPTS[-1], max_tokens=400, temperature=0.0, ignore_eos=True,
                                               speculative=True), timeout=600)
            async for response in call:
                if response.WhichOneof("kind") == "chunk" and response.chunk.token_ids:
                    break
            call.cancel()
        after = await _idle(decode, spares)
        assert unspared_free_pages(after) == unspared_free_pages(idle)
        log = Path(tmp_path, "prefill-0.log").read_text()
        assert f"{transport} handoff of" in log
    finally:
        await asyncio.to_thread(cluster.stop)
    assert not existing_segments(segments)


async def test_k3_state_layout_mismatch_is_failed_precondition(k3_model, tmp_path):
    """Prefill at TP=1 holds all 24 KDA heads per rank, decode at TP=2 twelve: their layout hashes differ
    (the state shapes), so the request is refused with FAILED_PRECONDITION naming the layout mismatch before
    any byte moves, and decode gets its pages and state slot back."""
    import grpc

    cluster: Cluster = await asyncio.to_thread(launch, k3_model, tmp_path, prefill_tp=1, decode_tp=2)
    try:
        decode = worker_address(cluster, "decode-0")
        idle = await _idle(decode, spares=1)
        async with gateway_stub(cluster.gateway_address) as stub:
            with pytest.raises(grpc.aio.AioRpcError) as error:
                async for _ in stub.Generate(build_request(PROMPTS[5], max_tokens=4, temperature=0.0), timeout=120):
                    pass
        assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "layout mismatch" in error.value.details().lower()
        after = await _idle(decode, spares=1)
        assert unspared_free_pages(after) == unspared_free_pages(idle)
    finally:
        await asyncio.to_thread(cluster.stop)
