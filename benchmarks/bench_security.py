"""Gateway throughput with TLS + an API key vs plaintext, in one run (issue 15's benchmark).

One deployment (1 prefill + 1 decode worker on Unix sockets, torch attention, shm KV) and two gateways
over the same workers: the plaintext one `pdserve up` starts, and a second started with --tls-cert /
--tls-key (a self-signed P-256 certificate made here with openssl) and --api-key-file. The client
(bench.client.GatewayClient, as `pdserve bench`) drives each through one warm channel, closed loop at
--concurrency, the TLS channel carrying the key as a bearer token (access-token call credentials).
The two variants take turns; --repeats runs each (after a warm-up run), medians and spread are printed
with the load average. Goal: TLS + token >= 95% of plaintext throughput at concurrency 16.

Run: .venv/bin/python -m benchmarks.bench_security [--repeats 5] [--concurrency 16]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

from bench.client import GatewayClient, SamplingOptions
from bench.load import LoadPlan, run_load
from bench.metrics import compute_metrics
from bench.workload import BenchRequest
from benchmarks.common import (add_common_arguments, goal_line, interleave, make_prompts, median, print_header,
                               ratio)
from pdserve.launcher import Cluster, ClusterSpec
from pdserve.process_groups import PARENT_ENV
from rpc.server import read_ready_file

API_KEY = "bench-security-key"


def self_signed(directory: Path) -> tuple[Path, Path]:
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"], check=True, capture_output=True)
    return cert, key


def start_tls_gateway(cluster: Cluster, model: Path, cert: Path, key: Path, keys: Path, log: Path) -> tuple[subprocess.Popen, str]:
    ready = log.with_suffix(".addr")
    command = [sys.executable, "-m", "pdserve.cli", "--log-level", "WARNING", "gateway", "--listen", "127.0.0.1:0",
               "--http-listen", "127.0.0.1:0",
               "--model", str(model), "--tls-cert", str(cert), "--tls-key", str(key), "--api-key-file", str(keys),
               "--ready-file", str(ready)]
    for child in cluster.children:
        if child.role.split("-")[0] in ("prefill", "decode"):
            command += [f"--{child.role.split('-')[0]}", child.address]
    process = subprocess.Popen(command, stdout=log.open("ab"), stderr=subprocess.STDOUT,
                               env={**os.environ, PARENT_ENV: str(os.getpid())})
    deadline = time.monotonic() + 300
    while not ready.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the TLS gateway did not start (see {log})")
        time.sleep(0.1)
    return process, read_ready_file(str(ready))[0]


class Runner:
    def __init__(self, name: str, channel: grpc.aio.Channel, loop: asyncio.AbstractEventLoop) -> None:
        self.name, self.channel, self.loop = name, channel, loop

    def run(self, prompts: list[list[int]], output_len: int, concurrency: int) -> dict[str, float]:
        client = GatewayClient(self.channel, SamplingOptions(temperature=0.0, speculative=False))
        requests = [BenchRequest(output_len=output_len, ignore_eos=True, token_ids=tuple(p)) for p in prompts]
        outcome = self.loop.run_until_complete(run_load(requests, client.send, LoadPlan(max_concurrency=concurrency)))
        failed = [record.error for record in outcome.records if not record.success]
        if failed:
            raise RuntimeError(f"{len(failed)} requests failed, first: {failed[0]}")
        metrics = compute_metrics(outcome.records, outcome.duration_s)
        result = {"tok_s": metrics.output_throughput, "ttft_ms": metrics.ttft_ms.median or float("nan")}
        print(f"  {self.name}: {result['tok_s']:.1f} tok/s, TTFT p50 {result['ttft_ms']:.1f} ms "
              f"(load average {os.getloadavg()[0]:.1f})", flush=True)
        return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_arguments(parser, repeats=5)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.requests = 2, 16
    print_header("bench_security: gateway with TLS + API key vs plaintext", args)
    work = Path(tempfile.mkdtemp(prefix="bench-security-"))
    cert, key = self_signed(work)
    keys = work / "api-keys"
    keys.write_text(API_KEY + "\n")
    spec = ClusterSpec(model_dir=str(args.model), listen="127.0.0.1:0", attention_backend="torch",
                       worker_args=("--num-threads", str(args.threads), "--kv-memory-mb", "256"), log_level="WARNING")
    cluster = Cluster(spec, log_dir=work)
    plain_address = cluster.start(timeout_s=600)
    tls_process, tls_address = start_tls_gateway(cluster, args.model, cert, key, keys, work / "gateway-tls.log")
    loop = asyncio.new_event_loop()
    try:
        credentials = grpc.composite_channel_credentials(grpc.ssl_channel_credentials(cert.read_bytes()),
                                                         grpc.access_token_call_credentials(API_KEY))
        async def channels() -> tuple[grpc.aio.Channel, grpc.aio.Channel]:  # bound to this loop
            return grpc.aio.insecure_channel(plain_address), grpc.aio.secure_channel(tls_address, credentials)

        plain_channel, secure_channel = loop.run_until_complete(channels())
        plain, secure = Runner("plaintext", plain_channel, loop), Runner("tls+token", secure_channel, loop)
        prompts, source = make_prompts(args.model, args.requests, args.input_len, args.seed, 320)
        print(f"gateways: plaintext {plain_address}, TLS + key {tls_address}; prompts: {source}, "
              f"{args.input_len} in / {args.output_len} out, {args.requests} requests at concurrency {args.concurrency}\n")
        runs = interleave({
            "plaintext": lambda: plain.run(prompts, args.output_len, args.concurrency),
            "tls+token": lambda: secure.run(prompts, args.output_len, args.concurrency),
        }, args.repeats)
        for name, samples in runs.items():
            rates = sorted(sample["tok_s"] for sample in samples)
            print(f"{name:10s} tok/s median {median(samples, 'tok_s'):8.1f}  min {rates[0]:8.1f}  max {rates[-1]:8.1f}  "
                  f"TTFT p50 median {median(samples, 'ttft_ms'):7.1f} ms")
        print(f"load average (1, 5, 15 min): {os.getloadavg()}\n")
        share = 100 * ratio(median(runs["tls+token"], "tok_s"), median(runs["plaintext"], "tok_s"))
        print(goal_line(f"TLS + token / plaintext throughput at concurrency {args.concurrency}", share, 95.0, unit="%"))
        for runner in (plain, secure):
            loop.run_until_complete(runner.channel.close())
    finally:
        loop.close()
        tls_process.terminate()
        tls_process.wait(30)
        cluster.stop()


if __name__ == "__main__":
    main()
