"""Prometheus metrics of every service on the shared deployment, parsed with prometheus_client's text
parser: after a known set of requests (3 completed, 1 refused, 1 aborted by a disconnecting client, 1
over gRPC) the counters and histogram counts moved by exactly that much."""
from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from gateway.client import build_request, generate
from tests.services.conftest import worker_address
from tests.services.helpers import Samples, at_rest, gateway_stub, idle_free_pages, scrape, wait_for_free_pages

pytestmark = pytest.mark.slow


def delta(after: Samples, before: Samples, name: str, **labels: str) -> float:
    key = (name, frozenset(labels.items()))
    assert key in after, f"{name}{labels} not exported"
    return after[key] - before.get(key, 0.0)


def _unspared_free(samples: Samples) -> float:
    """Free pages plus those the gateway's spare holds: what would be free without it."""
    return samples[("pdserve_kv_pages_free", frozenset())] + samples[("pdserve_kv_pages_standing", frozenset())]


async def test_counters_and_histograms_move_as_expected(cluster):
    """Gateway: requests by (api, status, code), TTFT / e2e / queue-time counts, tokens; prefill: prompts,
    KV transfer bytes and seconds by transport; decode: reservations, pages back to idle, nothing running."""
    endpoints = cluster.metrics_addresses()
    assert {"gateway", "prefill-0", "decode-0"} <= set(endpoints)
    decode = worker_address(cluster, "decode-0")
    baseline_pages = await idle_free_pages(decode)
    url = f"http://{cluster.http_address}"
    async with aiohttp.ClientSession() as http:
        before = {role: await scrape(http, address) for role, address in endpoints.items()}
        async with http.get(f"{url}/v1/models") as response:
            model = (await response.json())["data"][0]["id"]
        body = {"model": model, "prompt": [5, 6, 7, 8], "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
        for _ in range(3):
            async with http.post(f"{url}/v1/completions", json=body) as response:
                assert response.status == 200
        async with http.post(f"{url}/v1/completions", json={**body, "top_p": 7}) as response:
            assert response.status == 400
        stream = await http.post(f"{url}/v1/completions", json={**body, "max_tokens": 2000, "stream": True})
        for _ in range(2):  # the first token (from prefill), then one from decode: its lease is claimed
            assert (await stream.content.readuntil(b"\n\n")).startswith(b"data: ")
        stream.close()  # the aborted one
        async with gateway_stub(cluster.gateway_address) as stub:
            await generate(stub, build_request([5, 6, 7], max_tokens=4, temperature=0.0, ignore_eos=True), timeout=120)
        load = await wait_for_free_pages(decode, baseline_pages, timeout=30)
        assert at_rest(load, baseline_pages), load
        deadline = time.monotonic() + 30
        while True:  # the aborted request is counted once its handler has unwound; decode scraped at rest (a
            # scrape that caught the gateway's spare being replaced reads free + standing pages off: scrape again)
            after = {role: await scrape(http, address) for role, address in endpoints.items()}
            gateway, decoded = after["gateway"], after["decode-0"]
            if (delta(gateway, before["gateway"], "pdserve_requests_total", api="http", status="abort", code="499") >= 1
                    and _unspared_free(decoded) == baseline_pages):
                break
            assert time.monotonic() < deadline, ("the aborted request was never counted, or decode never idle",
                                                 _unspared_free(decoded), baseline_pages)
            await asyncio.sleep(0.05)
    old = before["gateway"]
    assert delta(gateway, old, "pdserve_requests_total", api="http", status="length", code="200") == 3
    assert delta(gateway, old, "pdserve_requests_total", api="http", status="error", code="400") == 1
    assert delta(gateway, old, "pdserve_requests_total", api="http", status="abort", code="499") == 1
    assert delta(gateway, old, "pdserve_requests_total", api="grpc", status="length", code="OK") == 1
    for histogram in ("pdserve_time_to_first_token_seconds", "pdserve_e2e_request_latency_seconds",
                      "pdserve_request_queue_time_seconds"):
        assert delta(gateway, old, f"{histogram}_count") == 5, histogram  # 3 + aborted + gRPC; not the refused one
    assert delta(gateway, old, "pdserve_inter_token_latency_seconds_count") >= 4 * 3
    assert delta(gateway, old, "pdserve_generation_tokens_total") >= 4 * 4 + 1
    assert gateway[("pdserve_requests_running", frozenset())] == 0
    assert gateway[("pdserve_requests_waiting", frozenset())] == 0
    prefill, old_prefill = after["prefill-0"], before["prefill-0"]
    assert delta(prefill, old_prefill, "pdserve_prefill_requests_total", status="ok") == 5
    assert delta(prefill, old_prefill, "pdserve_kv_transfer_seconds_count", transport="shm") == 5
    assert delta(prefill, old_prefill, "pdserve_kv_transfer_bytes_total", transport="shm") > 0
    assert delta(prefill, old_prefill, "pdserve_prefill_queue_time_seconds_count") == 5
    old_decode = before["decode-0"]
    assert delta(decoded, old_decode, "pdserve_decode_reservations_total") == 5  # spares count once claimed
    assert _unspared_free(decoded) == baseline_pages
    assert decoded[("pdserve_standing_leases", frozenset())] == 1  # the gateway's spare, and no other lease
    assert decoded[("pdserve_kv_pages_leased", frozenset())] == decoded[("pdserve_kv_pages_standing", frozenset())]
    assert decoded[("pdserve_decode_requests_running", frozenset())] == 0
    for name in ("pdserve_preemptions_total", "pdserve_lease_expiries_total", "pdserve_spec_verify_steps_total"):
        assert delta(decoded, old_decode, name) >= 0
    assert delta(decoded, old_decode, "pdserve_spec_verify_steps_total") > 0  # the deployment runs its draft
