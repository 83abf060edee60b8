"""Decode-side prefix reuse and conditional disaggregation (issue 34 items 1 and 4) through real processes: gateway +
1 prefill + 1 decode worker (`pdserve up`'s launcher, shm transport, speculation on), on models/pdserve-tiny and the
default K3 model. Standing leases are off (a spare takes no prefix lookup); the gateway's disagg threshold is its
default.

Invariants:
- a request sharing a 600-token prefix with one served before reserves on the decode worker only the pages after its
  cached ones (37 full pages held there): the prefill worker's completion record covers exactly the other pages (the
  bytes of the written pages and the KDA state; a wrong range fails decode's checksum), usage reports the hit and
  the decode worker's metrics count it;
- a chat turn whose new part (past the decode worker's cached pages, for K3 past its state checkpoint) is shorter
  than the threshold is served with no Prefill RPC (the prefill worker's request counter does not move) and the
  decode worker counts a local prefill;
- every output equals the in-process engine's with the prefix cache off (greedy);
- after aborts, deadlines and a lease that expires holding a hit, the decode worker holds no page, lease or state
  slot, and stopping the deployment leaves no /dev/shm segment."""
from __future__ import annotations

import asyncio
import re
from pathlib import Path

import aiohttp
import grpc
import pytest

from engine.paths import DSV3_MODEL_DIR, K3_MODEL_DIR
from gateway.client import build_request, generate
from kvtransfer.layout import KVLayout
from pdserve.launcher import Cluster
from rpc.internal.v1 import kv_pb2, worker_pb2, worker_pb2_grpc
from tests.services.conftest import launch, worker_address
from tests.services.helpers import decode_load, gateway_stub, greedy, scrape, token_prompts
from tests.services.processes import existing_segments, group_members, mapped_kv_segments

pytestmark = pytest.mark.slow
MODELS = {"pdserve-tiny": DSV3_MODEL_DIR, "k3-default": K3_MODEL_DIR}
PAGE = 16
MAX_TOKENS = 8
SHARED = token_prompts((600,), seed=5)[0]  # 37 full pages + 8 tokens
FIRST = SHARED + token_prompts((20,), seed=6)[0]
# 910 tokens: its 8 decoded tokens cross the page boundary at 912, where the decode worker keeps a KDA checkpoint
SECOND = SHARED + token_prompts((310,), seed=7)[0]
NEW_MESSAGE = token_prompts((10,), seed=8)[0]


@pytest.fixture(scope="module", params=list(MODELS))
def model(request: pytest.FixtureRequest) -> Path:
    return MODELS[request.param]


@pytest.fixture(scope="module")
def reference(model: Path) -> dict[str, object]:
    """In-process greedy outputs with the prefix cache off: FIRST, SECOND and the chat turn after SECOND; and the
    handoff layout (bytes per page and per state slot)."""
    from engine import LLM

    with LLM(str(model), attention_backend="torch", prefix_cache=False, num_threads=1) as llm:
        first, second = llm.generate([FIRST, SECOND], greedy(MAX_TOKENS, None))
        turn = SECOND + second + NEW_MESSAGE
        [third] = llm.generate([turn], greedy(MAX_TOKENS, None))
        layout = KVLayout.from_cache_shape(llm.engine.cache_shape)
    return {"outputs": [first, second, third], "turn": turn, "layout": layout}


def _launch(model: Path, log_dir: Path, transport: str = "shm") -> Cluster:
    return launch(model, log_dir, transport=transport, gateway_args=("--standing-lease-tokens", "0"))


async def _ask(address: str, prompt: list[int], max_tokens: int = MAX_TOKENS):
    async with gateway_stub(address) as stub:
        return await generate(stub, build_request(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                              timeout=600)


async def _counters(cluster: Cluster) -> dict[str, float]:
    """The counters these tests read, from the decode and prefill workers' /metrics."""
    addresses = cluster.metrics_addresses()
    async with aiohttp.ClientSession() as http:
        decode = await scrape(http, addresses["decode-0"])
        prefill = await scrape(http, addresses["prefill-0"])
    return {"decode_cached": decode[("pdserve_decode_cached_tokens_total", frozenset())],
            "local_prefills": decode[("pdserve_decode_local_prefills_total", frozenset())],
            "prefills": prefill.get(("pdserve_prefill_requests_total", frozenset({("status", "ok")})), 0.0)}


def _handoff_bytes(log_dir: Path, transport: str) -> list[int]:
    return [int(n) for n in re.findall(rf"{transport} handoff of (\d+) bytes", (log_dir / "prefill-0.log").read_text())]


@pytest.mark.parametrize("transport", ["shm", "grpc", "device"])
async def test_shared_prefix_reserves_and_writes_only_the_suffix_pages(model, reference, transport, tmp_path):
    """The second request's reservation holds the decode worker's 37 cached pages and the prefill worker writes (shm
    in place; device: the CPU's memfd stand-in of IPC pools) or pushes (grpc) only the pages after them (bytes =
    those pages + the whole KDA state, what the completion record / the pushed chunks cover); the texts equal the
    cache-off engine's."""
    if transport == "device" and model == K3_MODEL_DIR:
        pytest.skip("the device transport carries no KDA state yet (prefill_worker/service.py refuses it)")
    layout: KVLayout = reference["layout"]
    cluster = await asyncio.to_thread(_launch, model, tmp_path, transport)
    try:
        first = await _ask(cluster.gateway_address, FIRST)
        before = await _counters(cluster)
        second = await _ask(cluster.gateway_address, SECOND)
        after = await _counters(cluster)
    finally:
        await asyncio.to_thread(cluster.stop)
    assert [first.token_ids, second.token_ids] == reference["outputs"][:2]
    cached = 37 * PAGE
    assert first.complete.usage.cached_tokens == 0 and second.complete.usage.cached_tokens == cached
    assert before["decode_cached"] == 0 and after["decode_cached"] == cached
    assert after["prefills"] == before["prefills"] + 1 and after["local_prefills"] == 0  # 310 new tokens: disaggregated
    pages = -(-len(SECOND) // PAGE)
    assert _handoff_bytes(tmp_path, transport) == [layout.request_bytes(-(-len(FIRST) // PAGE)),
                                        layout.request_bytes(pages - cached // PAGE)]


async def test_short_suffix_turn_is_prefilled_on_the_decode_worker(model, reference, tmp_path):
    """The chat turn after SECOND (its history + 10 new tokens) is prefilled by the decode worker from its cached
    pages (K3: from its state checkpoint at 912 tokens): no Prefill RPC, the same text as the cache-off engine."""
    cluster = await asyncio.to_thread(_launch, model, tmp_path)
    try:
        second = await _ask(cluster.gateway_address, SECOND)
        before = await _counters(cluster)
        third = await _ask(cluster.gateway_address, reference["turn"])
        after = await _counters(cluster)
    finally:
        await asyncio.to_thread(cluster.stop)
    assert [second.token_ids, third.token_ids] == reference["outputs"][1:]
    assert after["prefills"] == before["prefills"] == 1  # the turn never reached the prefill worker
    assert after["local_prefills"] == before["local_prefills"] + 1 == 1
    assert third.complete.usage.cached_tokens == 912 and third.complete.usage.prompt_tokens == len(reference["turn"])
    assert third.complete.usage.completion_tokens == MAX_TOKENS


async def _status_within(stub, prompt: list[int], timeout: float) -> grpc.StatusCode:
    """The status a 4,000-token request ends with under a `timeout` s deadline: the gateway's Error message, or
    the call's status when the client's deadline struck first."""
    try:
        result = await generate(stub, build_request(prompt, max_tokens=4000, temperature=0.0, ignore_eos=True),
                                timeout=timeout)
    except grpc.aio.AioRpcError as error:
        return error.code()
    assert result.error is not None, "a 4,000-token request finished within its deadline"
    return next(code for code in grpc.StatusCode if code.value[0] == result.error.code)


async def _reserve_and_abandon(address: str, prompt: list[int]) -> kv_pb2.KVDestination:
    """A Reserve (with the prompt: it takes a hit) that nobody claims; its lease lasts the call's ~2 s deadline."""
    async with grpc.aio.insecure_channel(address) as channel:
        response = await worker_pb2_grpc.DecodeServiceStub(channel).Reserve(
            worker_pb2.ReserveRequest(request_id="abandoned", num_prompt_tokens=len(prompt), max_new_tokens=8,
                                      transport=kv_pb2.TRANSPORT_SHM, prompt_token_ids=prompt), timeout=2.0)
    return response.destination


async def _at_rest(address: str, timeout: float = 120.0) -> worker_pb2.GetDecodeLoadResponse:
    """Polls the decode worker until nothing runs, waits or is leased and every page and state slot is free."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        load = await decode_load(address)
        if ((load.running, load.waiting, load.leases) == (0, 0, 0) and load.free_pages == load.total_pages
                and load.free_state_slots == load.total_state_slots):
            return load
        assert asyncio.get_running_loop().time() < deadline, f"decode worker never came to rest: {load}"
        await asyncio.sleep(0.05)


async def test_nothing_leaks_after_aborts_deadlines_and_expiry_with_hits_held(model, reference, tmp_path):
    """With the decode worker's cache holding SECOND's pages: a local-prefill turn cancelled mid-decode, a disaggregated
    and a local request cut by their deadlines, and a reservation holding a hit that expires unclaimed leave every
    page, lease and state slot free (cached pages count as free only once no lease or request references them);
    stopping the deployment leaves no shm segment behind."""
    cluster = await asyncio.to_thread(_launch, model, tmp_path)
    try:
        processes = set().union(*(group_members(child.process.pid) for child in cluster.children))
        segments = mapped_kv_segments(processes)
        assert segments
        decode = worker_address(cluster, "decode-0")
        await _ask(cluster.gateway_address, SECOND)
        turn = reference["turn"]
        async with gateway_stub(cluster.gateway_address) as stub:
            call = stub.Generate(build_request(turn, max_tokens=400, temperature=0.0, ignore_eos=True), timeout=600)
            async for response in call:  # a client that leaves once the local prefill's first token is out
                if response.WhichOneof("kind") == "chunk" and response.chunk.token_ids:
                    break
            call.cancel()
            for prompt in (turn, SECOND + NEW_MESSAGE * 30):  # local, then disaggregated (300 new tokens)
                assert await _status_within(stub, prompt, 0.5) == grpc.StatusCode.DEADLINE_EXCEEDED
        destination = await _reserve_and_abandon(decode, turn)
        assert destination.cached_tokens >= 896  # the lease holds the hit's pages until it expires
        load = await _at_rest(decode)
        async with aiohttp.ClientSession() as http:
            samples = await scrape(http, cluster.metrics_addresses()["decode-0"])
        assert samples[("pdserve_lease_expiries_total", frozenset())] >= 1
        assert load.free_pages == load.total_pages
    finally:
        await asyncio.to_thread(cluster.stop)
    assert not existing_segments(segments)
