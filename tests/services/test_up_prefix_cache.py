"""The prefix cache through `pdserve up` (the disaggregated path, --disagg-threshold-tokens 0: the prefill worker's own
cache; the decode worker's, tests/services/test_decode_reuse.py), on the default K3 model and on models/pdserve-tiny,
each with its draft (speculation on).

Invariants: the second of two requests sharing a 1,500-token prefix reports >= 1,400 cached prompt tokens (the
larger of the prefill and the decode worker's hits), in gRPC's Complete.usage.cached_tokens and in OpenAI's
usage.prompt_tokens_details.cached_tokens; the greedy text of
both equals a `pdserve up --no-prefix-cache` deployment's, which reports 0 cached tokens; the prefill worker's
metrics count the hit (and, with the cache off, nothing)."""
from __future__ import annotations

import asyncio
import json
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from engine.paths import DSV3_MODEL_DIR, K3_MODEL_DIR
from gateway.client import build_request, generate
from tests.services.helpers import gateway_stub, log_tail, token_prompts

SHARED = token_prompts((1500,), seed=5)[0]
PROMPTS = [SHARED + token_prompts((20,), seed=6)[0], SHARED + token_prompts((12,), seed=7)[0]]


def _banner(process: subprocess.Popen[str], timeout: float, log_path) -> dict[str, str]:
    """gateway / http / metrics lines of up's banner, read by a thread (readline blocks); on failure the assertion
    carries the tail of up's log (its stderr: the workers' too)."""
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in process.stdout], daemon=True).start()
    patterns = {"gateway": r"pdserve is up: gateway (\S+)", "http": r"http \(OpenAI API\): (\S+)",
                "metrics": r"^metrics: (.*)"}
    found: dict[str, str] = {}
    deadline = time.monotonic() + timeout
    while len(found) < len(patterns):
        if time.monotonic() >= deadline or process.poll() is not None:
            raise AssertionError(f"pdserve up did not come up (exit code {process.poll()}): {found}\n"
                                 f"{log_tail(log_path)}")
        try:
            line = lines.get(timeout=1.0)
        except queue.Empty:
            continue
        found.update({key: m.group(1) for key, pattern in patterns.items() if (m := re.search(pattern, line))})
    return found


def _serve_two(model: str, cache: bool, log_path) -> tuple[list[str], list[int], list[int], dict[str, float]]:
    """Starts `pdserve up`, sends the two prompts one after the other (the first over gRPC, the second over the
    OpenAI API), stops it; returns their texts, gRPC / HTTP cached tokens and the prefill worker's cache metrics."""
    command = [sys.executable, "-m", "pdserve.cli", "up", "--model", model, "--listen", "127.0.0.1:0",
               "--http-listen", "127.0.0.1:0", "--num-threads", "1",
               "--disagg-threshold-tokens", "0"] + ([] if cache else ["--no-prefix-cache"])
    with open(log_path, "w") as log:
        up = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True)
        try:
            banner = _banner(up, timeout=300, log_path=log_path)

            async def first():
                async with gateway_stub(banner["gateway"]) as stub:
                    return await generate(stub, build_request(PROMPTS[0], max_tokens=8, temperature=0.0,
                                                              ignore_eos=True), timeout=300)

            result = asyncio.run(first())
            with urllib.request.urlopen(f"{banner['http']}/models", timeout=30) as response:
                served_model = json.load(response)["data"][0]["id"]
            body = json.dumps({"model": served_model, "prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0,
                               "ignore_eos": True}).encode()
            request = urllib.request.Request(f"{banner['http']}/completions", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=300) as response:
                answer = json.load(response)
            metrics = dict(item.split("=", 1) for item in banner["metrics"].split())
            with urllib.request.urlopen(metrics["prefill-0"], timeout=30) as response:
                scraped = {line.split()[0]: float(line.split()[1]) for line in response.read().decode().splitlines()
                           if line.startswith("pdserve_prefix_cache")}
            with urllib.request.urlopen(metrics["decode-0"], timeout=30) as response:
                scraped.update({line.split()[0]: float(line.split()[1]) for line in response.read().decode().splitlines()
                                if line.startswith("pdserve_decode_cached_tokens")})
            up.send_signal(signal.SIGINT)
            assert up.wait(timeout=90) == 0
        finally:
            if up.poll() is None:
                up.kill()
                up.wait()
    texts = [result.text, answer["choices"][0]["text"]]
    return texts, [result.complete.usage.cached_tokens], [answer["usage"]["prompt_tokens_details"]["cached_tokens"]], scraped


@pytest.mark.slow  # two whole deployments per model
@pytest.mark.parametrize("model", [str(K3_MODEL_DIR), str(DSV3_MODEL_DIR)], ids=["k3-default", "pdserve-tiny"])
def test_second_request_sharing_a_1500_token_prefix_is_served_from_the_cache(model, tmp_path):
    texts, grpc_cached, http_cached, scraped = _serve_two(model, True, tmp_path / "up.log")
    plain_texts, plain_grpc, plain_http, plain_scraped = _serve_two(model, False, tmp_path / "up-off.log")
    assert texts == plain_texts and all(texts)
    assert grpc_cached == [0] and http_cached[0] >= 1400
    assert plain_grpc == [0] and plain_http == [0]
    # usage: the larger of the prefill worker's hit (K3: up to its last state checkpoint) and the decode worker's
    # (its cached pages, which were not sent)
    assert max(scraped["pdserve_prefix_cache_hit_tokens_total"], scraped["pdserve_decode_cached_tokens_total"]) \
        == http_cached[0]
    assert scraped["pdserve_prefix_cache_queried_tokens_total"] == sum(map(len, PROMPTS))
    assert plain_scraped["pdserve_prefix_cache_hit_tokens_total"] == plain_scraped["pdserve_prefix_cache_pages"] == 0
