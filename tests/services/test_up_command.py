"""`pdserve up` (here 2 prefill + 2 decode workers and the grpc KV transport) prints every service's
metrics address, serves `pdserve generate` and routes over all its workers; Ctrl-C (SIGINT) stops every
process it started, leaving nothing in /dev/shm."""
from __future__ import annotations

import asyncio
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import psutil
import pytest

from gateway.client import build_request, generate
from gateway.tokenizer import TextTokenizer
from rpc.internal.v1 import worker_pb2, worker_pb2_grpc
from tests.services.helpers import gateway_stub, greedy, log_tail, token_prompts
from tests.services.processes import alive, descendants, existing_segments, mapped_kv_segments

UP_LINE = re.compile(r"pdserve is up: gateway (\S+)")
WORKERS_LINE = re.compile(r"(prefill|decode) workers:\s+(.*)")
METRICS_LINE = re.compile(r"^metrics: (.*)")


def _read_until_up(process: subprocess.Popen[str], timeout: float,
                   log_path: Path) -> tuple[str, dict[str, list[str]], dict[str, str]]:
    """The gateway address, the worker addresses and the metrics URLs from up's banner (read by a thread:
    readline blocks). A failure carries the tail of up's log (its stderr: the workers' too)."""
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in process.stdout], daemon=True).start()
    deadline = time.monotonic() + timeout
    seen, address, workers, metrics = [], "", {}, {}
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1.0)
        except queue.Empty:
            if process.poll() is not None:
                raise AssertionError(f"pdserve up exited with {process.returncode}: {seen}\n{log_tail(log_path)}")
            continue
        seen.append(line)
        match, listed = UP_LINE.search(line), WORKERS_LINE.search(line)
        address = match.group(1) if match else address
        if listed:
            workers[listed.group(1)] = listed.group(2).split()
        if METRICS_LINE.search(line):
            metrics = dict(item.split("=", 1) for item in METRICS_LINE.search(line).group(1).split())
        if address and len(workers) == 2 and metrics:
            return address, workers, metrics
    raise AssertionError(f"pdserve up did not come up in {timeout} s: {seen}\n{log_tail(log_path)}")


def _requests_served(workers: dict[str, list[str]]) -> dict[str, list[int]]:
    async def ask() -> dict[str, list[int]]:
        served: dict[str, list[int]] = {"prefill": [], "decode": []}
        for role, addresses in workers.items():
            for address in addresses:
                async with grpc.aio.insecure_channel(address) as channel:
                    if role == "prefill":
                        load = await worker_pb2_grpc.PrefillServiceStub(channel).GetPrefillLoad(
                            worker_pb2.GetPrefillLoadRequest(), timeout=10)
                    else:
                        load = await worker_pb2_grpc.DecodeServiceStub(channel).GetDecodeLoad(
                            worker_pb2.GetDecodeLoadRequest(), timeout=10)
                    served[role].append(load.requests_total)
        return served

    return asyncio.run(ask())


def _generate_many(address: str, prompts: list[list[int]]) -> list[list[int]]:
    async def run() -> list[list[int]]:
        async with gateway_stub(address) as stub:
            results = await asyncio.gather(*(generate(stub, build_request(p, max_tokens=6, temperature=0.0, ignore_eos=True,
                                                                          speculative=False), timeout=120) for p in prompts))
        return [result.token_ids for result in results]

    return asyncio.run(run())


def _assert_roles_on_disjoint_cores(pids: set[int]) -> None:
    """On a CPU node with >= 2 cores, up pins prefill and decode workers (engine processes included) apart."""
    if len(os.sched_getaffinity(0)) < 2:
        return
    masks: dict[str, set[int]] = {"prefill": set(), "decode": set()}
    for pid in pids:
        try:
            command = psutil.Process(pid).cmdline()
            cores = set(os.sched_getaffinity(pid))
        except (psutil.NoSuchProcess, ProcessLookupError):
            continue
        for role in masks:
            if role in command:
                masks[role] |= cores
    assert masks["prefill"] and masks["decode"] and not masks["prefill"] & masks["decode"], masks


@pytest.mark.slow  # starts a whole deployment through `pdserve up`
def test_up_generate_and_ctrl_c(service_model, llm, tmp_path):
    """up prints where to connect; generate streams the greedy completion (== the in-process engine's text);
    concurrent requests are spread over both prefill and both decode workers with unchanged outputs;
    SIGINT makes up exit 0 with none of its descendants alive and its KV segments unlinked."""
    prompt = token_prompts((40,), seed=7)[0]
    expected = TextTokenizer.from_model_dir(service_model).decode(llm.generate([prompt], greedy(10, False))[0])
    many = token_prompts(tuple(range(5, 125, 10)), seed=11)
    log = open(tmp_path / "up.log", "w")  # noqa: SIM115
    up = subprocess.Popen(
        [sys.executable, "-m", "pdserve.cli", "up", "--model", str(service_model), "--listen", "127.0.0.1:0",
         "--http-listen", "127.0.0.1:0", "--transport", "grpc", "--attention-backend", "torch", "--num-threads", "1", "--kv-memory-mb", "64",
         "--draft-model", "", "--num-prefill", "2", "--num-decode", "2", "--disagg-threshold-tokens", "0"],
        stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True)
    try:
        address, workers, metrics = _read_until_up(up, timeout=300, log_path=tmp_path / "up.log")
        assert len(workers["prefill"]) == len(workers["decode"]) == 2
        assert set(metrics) == {"gateway", "prefill-0", "prefill-1", "decode-0", "decode-1"}
        for url in metrics.values():  # every service answers its printed metrics address
            with urllib.request.urlopen(url, timeout=30) as response:
                assert response.status == 200 and b"# TYPE pdserve_" in response.read()
        processes = descendants(up.pid)
        segments = mapped_kv_segments(processes)
        assert len(processes) >= 5 and len(segments) >= 2
        _assert_roles_on_disjoint_cores(processes)
        generated = subprocess.run(
            [sys.executable, "-m", "pdserve.cli", "generate", "--gateway", address, "--token-ids",
             ",".join(map(str, prompt)), "--max-tokens", "10", "--temperature", "0", "--ignore-eos", "--no-spec"],
            capture_output=True, text=True, timeout=120)
        assert generated.returncode == 0, generated.stderr
        assert generated.stdout == expected + "\n"
        assert "[length] 10 tokens" in generated.stderr
        assert _generate_many(address, many) == llm.generate(many, greedy(6, False))
        served = _requests_served(workers)
        assert sum(served["decode"]) == sum(served["prefill"]) == len(many) + 1
        assert min(served["decode"]) > 0 and min(served["prefill"]) > 0, served
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=90) == 0
        assert not alive(processes)
        assert not existing_segments(segments)
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
        log.close()
