"""HTTP (OpenAI API, SSE) vs gRPC streaming through the same gateway, in one run (issue 17).

Launches 1 prefill + 1 decode worker (TP 1, shm KV transport, torch attention, speculation off so every
token is its own chunk: the most per-chunk work for either front) and the gateway with its HTTP front on
loopback. The same prompts (held-out Python token ids, fixed lengths, greedy, ignore eos) go through
  grpc   bench.client.GatewayClient over one warm channel (what `pdserve bench` uses), and
  http   bench.openai_client.OpenAIClient over one warm aiohttp session: streaming /v1/completions
         with stream_options.include_usage (what `pdserve bench --backend openai` uses),
closed loop at concurrency C. Variants take turns (the order alternates each round); medians of
--repeats with the spread (min..max) and the load average printed. Goals: HTTP output throughput
>= 90% of gRPC's, added TTFT (p50) <= 3 ms.

Run: .venv/bin/python -m benchmarks.bench_http [--model DIR] [--repeats 5] [--quick]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import grpc

from bench.client import GatewayClient, SamplingOptions
from bench.load import LoadPlan, run_load
from bench.metrics import compute_metrics
from bench.openai_client import OpenAIClient
from bench.workload import BenchRequest
from benchmarks.bench_gateway import request_count
from benchmarks.common import (Metrics, Table, add_common_arguments, goal_line, interleave, make_prompts, median,
                               print_header, process_cpu_seconds, ratio)
from pdserve.launcher import Cluster, ClusterSpec

OPTIONS = SamplingOptions(temperature=0.0)


class Fronts:
    """One event loop, one warm gRPC channel and one warm HTTP session, reused by every run."""

    def __init__(self, grpc_address: str, http_address: str, gateway_pid: int) -> None:
        self.gateway_pid = gateway_pid
        self.loop = asyncio.new_event_loop()
        self.channel, self.session = self.loop.run_until_complete(self._connect(grpc_address))
        self.clients: dict[str, Any] = {"grpc": GatewayClient(self.channel, OPTIONS),
                                        "http": OpenAIClient(self.session, f"http://{http_address}/v1", OPTIONS)}
        for name, client in self.clients.items():
            self.loop.run_until_complete(client.model_info(grpc_address if name == "grpc" else http_address, 60.0))

    @staticmethod
    async def _connect(grpc_address: str) -> tuple[grpc.aio.Channel, aiohttp.ClientSession]:
        """Both made inside the loop that will use them."""
        return grpc.aio.insecure_channel(grpc_address), aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    def run(self, front: str, prompts: list[list[int]], output_len: int, concurrency: int) -> Metrics:
        """Also the gateway's and this client's CPU milliseconds per output token (user + system)."""
        requests = [BenchRequest(output_len=output_len, ignore_eos=True, token_ids=tuple(p)) for p in prompts]
        gateway_cpu, client_cpu = process_cpu_seconds(self.gateway_pid), time.process_time()
        outcome = self.loop.run_until_complete(
            run_load(requests, self.clients[front].send, LoadPlan(max_concurrency=concurrency)))
        gateway_cpu, client_cpu = process_cpu_seconds(self.gateway_pid) - gateway_cpu, time.process_time() - client_cpu
        failed = [r.error for r in outcome.records if not r.success]
        if failed:
            raise RuntimeError(f"{len(failed)} {front} requests failed, first: {failed[0]}")
        metrics = compute_metrics(outcome.records, outcome.duration_s)
        tokens = metrics.total_output_tokens
        return {"tok_s": metrics.output_throughput, "ttft_ms": metrics.ttft_ms.median or float("nan"),
                "tpot_ms": metrics.tpot_ms.median or float("nan"), "load": os.getloadavg()[0],
                "cpu_gateway": 1e3 * gateway_cpu / tokens, "cpu_client": 1e3 * client_cpu / tokens}

    def close(self) -> None:
        self.loop.run_until_complete(self.session.close())
        self.loop.run_until_complete(self.channel.close())
        self.loop.close()


def spread(samples: list[Metrics], key: str) -> str:
    values = [s[key] for s in samples]
    return f"{min(values):,.0f}..{max(values):,.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_arguments(parser, repeats=5)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--kv-memory-mb", type=int, default=512)
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.output_len = min(args.repeats, 2), 16
    print_header("bench_http: OpenAI HTTP (SSE) vs gRPC streaming through the same gateway", args)
    log_dir = Path(tempfile.mkdtemp(prefix="bench-http-"))
    spec = ClusterSpec(model_dir=str(args.model), listen="127.0.0.1:0", http_listen="127.0.0.1:0",
                       attention_backend="torch", transport="shm", draft_model="", log_level="WARNING",
                       worker_args=("--num-threads", str(args.threads), "--kv-memory-mb", str(args.kv_memory_mb)))
    cluster = Cluster(spec, log_dir=log_dir)
    address = cluster.start(timeout_s=300)
    print(f"cluster: gateway gRPC {address}, HTTP {cluster.http_address}; 1 prefill + 1 decode worker (TP 1, shm, "
          f"torch attention, {args.threads} threads each, speculation off), logs in {log_dir}\n", flush=True)
    goals = []
    try:
        gateway_pid = next(child.process.pid for child in cluster.children if child.role == "gateway")
        fronts = Fronts(address, cluster.http_address, gateway_pid)
        try:
            from engine.model_configs.model_config import ModelConfig

            config = ModelConfig.from_pretrained(args.model)
            prompts, source = make_prompts(args.model, max(request_count(c) for c in args.concurrency),
                                           args.input_len, args.seed, config.vocab_size, list(config.eos_token_id))
            table = Table(f"HTTP vs gRPC streaming, greedy, {args.input_len} in / {args.output_len} out ({source}); "
                          f"medians of {args.repeats} interleaved runs, spread min..max",
                          ["concurrency", "requests", "gRPC tok/s", "HTTP tok/s", "HTTP / gRPC", "gRPC TTFT p50 ms",
                           "HTTP TTFT p50 ms", "added TTFT ms", "gRPC tok/s spread", "HTTP tok/s spread",
                           "load avg (1 min)"])
            cpu = Table("CPU milliseconds per output token in the runs above (user + system; medians)",
                        ["concurrency", "gateway, gRPC", "gateway, HTTP", "client, gRPC", "client, HTTP"])
            for concurrency in args.concurrency:
                batch = prompts[: request_count(concurrency)]
                runs = interleave({front: (lambda front=front: fronts.run(front, batch, args.output_len, concurrency))
                                   for front in ("grpc", "http")}, args.repeats)
                grpc_rate, http_rate = median(runs["grpc"], "tok_s"), median(runs["http"], "tok_s")
                added = median(runs["http"], "ttft_ms") - median(runs["grpc"], "ttft_ms")
                loads = [s["load"] for samples in runs.values() for s in samples]
                table.add(concurrency, len(batch), grpc_rate, http_rate, f"{100 * ratio(http_rate, grpc_rate):.1f}%",
                          median(runs["grpc"], "ttft_ms"), median(runs["http"], "ttft_ms"), added,
                          spread(runs["grpc"], "tok_s"), spread(runs["http"], "tok_s"),
                          f"{min(loads):.1f}..{max(loads):.1f}")
                cpu.add(concurrency, *(median(runs[front], f"cpu_{role}") for role in ("gateway", "client")
                                       for front in ("grpc", "http")))
                goals.append(goal_line(f"HTTP / gRPC throughput at concurrency {concurrency}",
                                       100 * ratio(http_rate, grpc_rate), 90.0, unit="%"))
                goals.append(goal_line(f"added TTFT p50 at concurrency {concurrency}", added, 3.0, unit=" ms",
                                       higher_is_better=False))
            table.print()
            cpu.print()
        finally:
            fronts.close()
    finally:
        cluster.stop()
    print("## Goals\n")
    for line in goals:
        print(f"- {line}")


if __name__ == "__main__":
    main()
