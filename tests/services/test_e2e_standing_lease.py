"""A second gateway with standing leases of its own size (256 tokens) on the shared deployment's workers (whose
own gateway keeps its default spare): outputs are the in-process engine's, fitting prompts take the spare,
and no page stays reserved once it stops."""
from __future__ import annotations

import asyncio
import time

import pytest

from gateway.config import GatewayConfig
from gateway.kv_index import Overlap
from gateway.workers import WorkerPool
from gateway.server import serve as serve_gateway
from gateway.standing_leases import StandingLeases
from tests.services.conftest import MAX_TOKENS, PROMPTS, worker_address
from tests.services.helpers import at_rest, decode_load, greedy_through_gateway, idle_free_pages, wait_for_free_pages

SPARE_TOKENS = 256


async def _wait(condition, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not await condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def test_standing_lease_gateway_matches_in_process_and_frees_its_spare(cluster, reference, service_model,
                                                                           tmp_path, monkeypatch):
    """One request at a time through a gateway keeping a spare of 256 tokens: every output (prompts of 1..2048
    tokens: the short ones on the spare, the long ones through Reserve) equals LLM.generate's; at least
    one request took a spare; while idle the decode worker shows its spare and the deployment gateway's as two
    standing leases (and no other lease); after it stops only the deployment gateway's spare is left and the
    pages but for it are back at their idle count."""
    decode = worker_address(cluster, "decode-0")
    idle = await idle_free_pages(decode)
    taken: list[str] = []
    spares: list[StandingLeases] = []
    take, start = StandingLeases.take, StandingLeases.start

    def recording_take(self, num_prompt_tokens, order):
        result = take(self, num_prompt_tokens, order)
        if result is not None:
            taken.append(result[1].request_id)
        return result

    monkeypatch.setattr(StandingLeases, "take", recording_take)
    # every short prompt takes the spare: this test is about spares, not about the index-driven choice to Reserve
    # a prompt the decode worker already holds part of (tests/gateway/test_standing_leases.py covers that)
    monkeypatch.setattr(WorkerPool, "overlap", lambda self, address, prompt: Overlap())
    monkeypatch.setattr(StandingLeases, "start", lambda self: spares.append(self) or start(self))
    stop, ready = asyncio.Event(), tmp_path / "standing.addr"
    config = GatewayConfig(model_dir=str(service_model), prefill=(worker_address(cluster, "prefill-0"),),
                           decode=(decode,), listen="127.0.0.1:0", load_poll_interval_s=0.05,
                           standing_lease_tokens=SPARE_TOKENS)
    task = asyncio.create_task(serve_gateway(config, stop=stop, ready_file=str(ready)))
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert time.monotonic() < deadline and not task.done(), "the gateway did not start"
            await asyncio.sleep(0.02)
        address = ready.read_text().strip()

        async def spare_held() -> bool:
            return len(spares) == 1 and len(spares[0].held()) == 1

        await _wait(spare_held, "the spare")

        async def two_spares() -> bool:
            load = await decode_load(decode)
            return (load.leases, load.standing_leases) == (2, 2)

        await _wait(two_spares, "two standing leases (this gateway's and the deployment's) and no other lease")
        outputs = []
        for prompt in PROMPTS:
            if len(prompt) <= SPARE_TOKENS:  # each short prompt gets a fresh spare (refilled after each take)
                await _wait(spare_held, "the spare")
            outputs += await greedy_through_gateway(address, [prompt], MAX_TOKENS, speculative=False)
        assert [result.token_ids for result in outputs] == reference[False]
        assert len(taken) == sum(len(prompt) <= SPARE_TOKENS for prompt in PROMPTS)
        assert len(set(taken)) == len(taken) and all(t.startswith("standing.") for t in taken)
    finally:
        stop.set()
        await task
    load = await wait_for_free_pages(decode, idle)
    assert at_rest(load, idle), load  # one spare left: the deployment gateway's


pytestmark = pytest.mark.slow
