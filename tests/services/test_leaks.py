"""No page is lost under deadlines and cancellation (issue 15, item 1), on a deployment whose prefill
worker runs small chunks (so a long prompt is many chunks and a cancel lands between two of them)."""
from __future__ import annotations

import asyncio
import random
import re
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from gateway.client import build_request
from pdserve.launcher import Cluster
from rpc.internal.v1 import worker_pb2, worker_pb2_grpc
from tests.services.conftest import launch, worker_address
from tests.services.helpers import at_rest, gateway_quiet, gateway_stub, idle_free_pages, token_prompts, wait_for_free_pages

pytestmark = pytest.mark.slow
PREFILL_CHUNK = 32


@pytest.fixture(scope="module")
def small_chunks(service_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    log_dir = tmp_path_factory.mktemp("leak_logs")
    cluster = launch(service_model, log_dir, prefill_args=("--max-batched-tokens", str(PREFILL_CHUNK)))
    yield cluster
    cluster.stop()


async def test_deadline_sweep_leaks_no_page(small_chunks):
    """200 one-token requests with deadlines of 1-60 ms (8 in flight at once), whatever each ends with,
    leave the decode worker at its idle free-page baseline with no lease and nothing running."""
    decode = worker_address(small_chunks, "decode-0")
    baseline = await idle_free_pages(decode)
    rng = random.Random(15)
    outcomes: dict[str, int] = {}

    async def one(stub, index: int) -> None:
        request = build_request([rng.randrange(4, 300)], max_tokens=rng.choice((1, 2, 8)), temperature=0.0,
                                ignore_eos=True)
        try:
            async for _ in stub.Generate(request, timeout=(1 + index % 60) / 1000):
                pass
            outcomes["ok"] = outcomes.get("ok", 0) + 1
        except grpc.aio.AioRpcError as error:
            outcomes[error.code().name] = outcomes.get(error.code().name, 0) + 1

    async with gateway_stub(small_chunks.gateway_address) as stub:
        for start in range(0, 200, 8):
            await asyncio.gather(*(one(stub, index) for index in range(start, start + 8)))
    assert sum(outcomes.values()) == 200 and outcomes.get("DEADLINE_EXCEEDED", 0) > 0, outcomes
    await gateway_quiet(small_chunks.http_address)  # every run ended, stragglers the clients left included
    load = await wait_for_free_pages(decode, baseline, timeout=60)
    assert at_rest(load, baseline), (load, outcomes)


async def test_cancel_during_long_prefill_stops_it_and_frees_pages(small_chunks):
    """A client cancelling while its 3000-token prompt is being prefilled (in 32-token chunks) stops the
    prefill between two chunks (the prefill worker says so) and the decode pages return to baseline;
    a request sent afterwards is served normally."""
    decode, prefill = worker_address(small_chunks, "decode-0"), worker_address(small_chunks, "prefill-0")
    await gateway_quiet(small_chunks.http_address)  # no straggler's Prefill may pass for this one's below
    baseline = await idle_free_pages(decode)
    prompt = token_prompts((3000,), seed=21)[0]
    async with gateway_stub(small_chunks.gateway_address) as stub, grpc.aio.insecure_channel(prefill) as channel:
        prefill_stub = worker_pb2_grpc.PrefillServiceStub(channel)
        accepted = (await prefill_stub.GetPrefillLoad(worker_pb2.GetPrefillLoadRequest(), timeout=10)).requests_total
        call = stub.Generate(build_request(prompt, max_tokens=4, temperature=0.0, request_id="long-prefill"),
                             timeout=300)
        deadline = time.monotonic() + 120
        while True:  # accepted by the prefill worker and taken off its queue: it is running
            load = await prefill_stub.GetPrefillLoad(worker_pb2.GetPrefillLoadRequest(), timeout=10)
            if load.requests_total > accepted and load.queued_requests == 0:
                break
            assert time.monotonic() < deadline, "the prefill never started"
            await asyncio.sleep(0.01)
        call.cancel()
        load = await wait_for_free_pages(decode, baseline, timeout=60)
        assert at_rest(load, baseline), load
        after = [response async for response in stub.Generate(
            build_request([5, 6, 7], max_tokens=3, temperature=0.0, ignore_eos=True), timeout=120)]
        assert after[-1].WhichOneof("kind") == "complete"
    log = Path(small_chunks.log_dir, "prefill-0.log").read_text()
    assert re.search(r"prefill of long-prefill\.\w+ stopped between chunks \(cancelled\)", log), log[-2000:]
