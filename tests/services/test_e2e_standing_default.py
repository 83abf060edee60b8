"""Standing leases on by default (issue 18): a deployment of 1 prefill + 2 decode workers behind a gateway with
default flags holds exactly one spare per decode worker once its requests finished, and SIGTERM to the gateway
releases them (no lease left, none left to expire); a gateway started with `--standing-lease-tokens 0` on the
same workers serves requests and holds no spare."""
from __future__ import annotations

import asyncio
import signal

import aiohttp
import pytest

from rpc.server import read_ready_file
from tests.services.conftest import MAX_TOKENS, PROMPTS, launch, worker_address
from tests.services.helpers import at_rest, greedy_through_gateway, idle_free_pages, scrape, wait_for_free_pages
from tests.services.processes import serving_gateway

pytestmark = pytest.mark.slow
CHOSEN = (2, 6, 9, 13, 14)  # prompts of 7, 64, 128, 1024 and 1500 tokens: the last one is past the spare's size


async def _expiries(http: aiohttp.ClientSession, address: str) -> float:
    return (await scrape(http, address))[("pdserve_lease_expiries_total", frozenset())]


async def test_default_spares_one_per_decode_worker_released_on_sigterm_and_off_with_zero(service_model, reference,
                                                                                          tmp_path):
    """Default gateway: greedy outputs of prompts of 7..1500 tokens (the short ones on spares) equal the
    in-process engine's and the gateway counts spares taken; afterwards each decode worker is at rest with
    exactly one spare (standing lease) and no other lease. SIGTERM: the gateway exits 0 and both workers are at
    rest with no lease at all, none of it freed by expiry. A gateway with --standing-lease-tokens 0 on the same
    workers then serves the same prompts identically, takes no spare and leaves no lease."""
    cluster = await asyncio.to_thread(launch, service_model, tmp_path, num_decode=2)
    prompts, expected = [PROMPTS[i] for i in CHOSEN], [reference[False][i] for i in CHOSEN]
    try:
        decode = [worker_address(cluster, f"decode-{i}") for i in range(2)]
        metrics = cluster.metrics_addresses()
        baselines = [await idle_free_pages(address) for address in decode]
        results = await greedy_through_gateway(cluster.gateway_address, prompts, MAX_TOKENS, speculative=False)
        assert [r.token_ids for r in results] == expected
        async with aiohttp.ClientSession() as http:
            gateway_metrics = await scrape(http, metrics["gateway"])
            assert gateway_metrics[("pdserve_standing_leases_taken_total", frozenset())] >= 1
            for address, baseline in zip(decode, baselines, strict=True):
                load = await wait_for_free_pages(address, baseline, spares=1)
                assert at_rest(load, baseline, spares=1), (address, load)
            gateway = next(child for child in cluster.children if child.role == "gateway")
            gateway.process.send_signal(signal.SIGTERM)
            assert await asyncio.to_thread(gateway.process.wait, 60) == 0
            for address, baseline in zip(decode, baselines, strict=True):
                load = await wait_for_free_pages(address, baseline, spares=0)
                assert at_rest(load, baseline, spares=0), (address, load)
            assert [await _expiries(http, metrics[f"decode-{i}"]) for i in range(2)] == [0, 0]

            flags = ["--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0", "--model", str(service_model),
                     "--standing-lease-tokens", "0", "--prefill", worker_address(cluster, "prefill-0"),
                     *(flag for address in decode for flag in ("--decode", address))]
            process, plain = await asyncio.to_thread(serving_gateway, flags, tmp_path / "plain-gateway.addr")
            try:
                results = await greedy_through_gateway(plain, prompts, MAX_TOKENS, speculative=False)
                assert [r.token_ids for r in results] == expected
                http_address = read_ready_file(str(tmp_path / "plain-gateway.addr"))[1]["http"]
                plain_metrics = await scrape(http, http_address)
                assert plain_metrics[("pdserve_standing_leases_taken_total", frozenset())] == 0
                assert plain_metrics[("pdserve_standing_leases_held", frozenset())] == 0
                for address, baseline in zip(decode, baselines, strict=True):
                    load = await wait_for_free_pages(address, baseline, spares=0)
                    assert at_rest(load, baseline, spares=0), (address, load)
            finally:
                process.send_signal(signal.SIGTERM)
                assert await asyncio.to_thread(process.wait, 60) == 0
    finally:
        await asyncio.to_thread(cluster.stop)
