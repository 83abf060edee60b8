"""Soak: minutes of mixed traffic with cancels and deadlines against a `pdserve up`-style deployment,
then checks that pages, leases, file descriptors, threads and RSS stayed flat (issue 15's acceptance).

Traffic (closed loop, --concurrency clients): random prompts of 1-600 tokens and 1-64 output tokens;
about 1 in 5 requests is cancelled after its first streamed chunk, 1 in 5 has a deadline of 1-200 ms,
1 in 20 is aborted through the Abort RPC, the rest run to completion. Every --sample-every seconds the
decode workers' loads and each process's fds / threads / RSS are sampled. At the end the deployment is
left to go idle and the last sample is compared with the first one taken after warm-up:
  pages and leases: exactly at the idle baseline (no leased page, nothing running; the gateway's spares -
  one standing lease per decode worker - count as free pages, a second one on a worker as a lease);
  fds and threads: within --fd-slack / --thread-slack of the warm-up value;
  RSS: grown by at most --rss-growth (fraction) over the warm-up value.
Exit status 0 when flat, 1 otherwise. Not part of CI's default run (it takes --duration seconds).

Run: .venv/bin/python -m benchmarks.soak [--duration 600] [--model DIR]
"""
from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from gateway.client import build_request
from pdserve.commands.common import DEFAULT_MODEL_DIR
from pdserve.launcher import Cluster, ClusterSpec
from rpc.internal.v1 import worker_pb2, worker_pb2_grpc
from rpc.v1 import gateway_pb2, gateway_pb2_grpc


@dataclass(frozen=True)
class ProcessSample:
    fds: int
    threads: int
    rss_kib: int


@dataclass(frozen=True)
class Sample:
    at_s: float
    free_pages: int
    leases: int
    running: int
    processes: dict[str, ProcessSample]


def process_sample(pid: int) -> ProcessSample:
    """Open fds, threads and resident memory of one process (Linux /proc)."""
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    fds = len(list(Path(f"/proc/{pid}/fd").iterdir()))
    return ProcessSample(fds, int(status["Threads"]), int(status["VmRSS"].split()[0]))


async def take_sample(started: float, decode: list[str], pids: dict[str, int]) -> Sample:
    """free_pages: free plus the spares' pages (gateway/standing_leases.py: what would be free without them);
    leases: every lease but one spare per worker (a leaked spare still counts)."""
    free = leases = running = 0
    for address in decode:
        async with grpc.aio.insecure_channel(address) as channel:
            load = await worker_pb2_grpc.DecodeServiceStub(channel).GetDecodeLoad(worker_pb2.GetDecodeLoadRequest(), timeout=30)
        free, running = free + load.free_pages + load.standing_pages, running + load.running
        leases += load.leases - min(load.standing_leases, 1)
    return Sample(time.monotonic() - started, free, leases, running, {role: process_sample(pid) for role, pid in pids.items()})


async def one_request(stub: gateway_pb2_grpc.GatewayServiceStub, rng: random.Random, index: int, counts: dict[str, int]) -> None:
    prompt = [rng.randrange(4, 300) for _ in range(rng.randint(1, 600))]
    kind = rng.choices(["complete", "cancel", "deadline", "abort"], weights=[11, 4, 4, 1])[0]
    request = build_request(prompt, max_tokens=rng.randint(1, 64), temperature=rng.choice([0.0, 0.8]),
                            ignore_eos=True, request_id=f"soak-{index}")
    timeout = rng.uniform(0.001, 0.2) if kind == "deadline" else 120.0
    try:
        call = stub.Generate(request, timeout=timeout)
        async for response in call:
            if kind == "cancel" and response.WhichOneof("kind") == "chunk":
                call.cancel()
                break
            if kind == "abort" and response.WhichOneof("kind") == "chunk":
                await stub.Abort(gateway_pb2.AbortRequest(request_id=f"soak-{index}"), timeout=30)
                kind = "aborted"
        counts[kind] = counts.get(kind, 0) + 1
    except grpc.aio.AioRpcError as error:
        name = "cancelled" if error.code() == grpc.StatusCode.CANCELLED else error.code().name
        counts[name] = counts.get(name, 0) + 1


async def soak(gateway: str, decode: list[str], pids: dict[str, int], duration_s: float, concurrency: int,
               sample_every_s: float, warm_up_s: float, seed: int) -> tuple[list[Sample], Sample, dict[str, int]]:
    """Runs the traffic; returns (samples during the run, the idle sample at the end, outcome counts)."""
    rng, counts, samples = random.Random(seed), {}, []
    started = time.monotonic()
    async with grpc.aio.insecure_channel(gateway) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        next_index = 0

        async def client() -> None:
            nonlocal next_index
            while time.monotonic() - started < duration_s:
                next_index += 1
                await one_request(stub, rng, next_index, counts)

        async def sampler() -> None:
            await asyncio.sleep(warm_up_s)
            while time.monotonic() - started < duration_s:
                samples.append(await take_sample(started, decode, pids))
                print(format_sample(samples[-1]), flush=True)
                await asyncio.sleep(sample_every_s)

        await asyncio.gather(sampler(), *(client() for _ in range(concurrency)))
    deadline = time.monotonic() + 120
    final, previous = await take_sample(started, decode, pids), None
    # let the last clean-ups land: no lease, nothing running, the same free pages twice (a spare's refill, and a
    # lease freed on the worker before its engine process reports the pages back, can skew one reading)
    while ((final.leases or final.running or previous is None or previous.free_pages != final.free_pages)
           and time.monotonic() < deadline):
        await asyncio.sleep(0.5)
        final, previous = await take_sample(started, decode, pids), final
    return samples, final, counts


def format_sample(sample: Sample) -> str:
    processes = "  ".join(f"{role}: fds {p.fds} threads {p.threads} rss {p.rss_kib / 1024:.0f} MiB"
                          for role, p in sample.processes.items())
    return (f"t={sample.at_s:6.0f}s  free pages {sample.free_pages}  leases {sample.leases}  running {sample.running}"
            f"  |  {processes}")


def flatness(first: Sample, final: Sample, idle_free_pages: int, fd_slack: int, thread_slack: int,
             rss_growth: float) -> list[str]:
    """The ways final is not flat against the warm-up sample (empty: flat)."""
    problems = []
    if (final.free_pages, final.leases, final.running) != (idle_free_pages, 0, 0):
        problems.append(f"pages: free {final.free_pages} (idle baseline {idle_free_pages}), leases {final.leases}, "
                        f"running {final.running}")
    for role, start in first.processes.items():
        end = final.processes[role]
        if end.fds > start.fds + fd_slack:
            problems.append(f"{role}: fds {start.fds} -> {end.fds}")
        if end.threads > start.threads + thread_slack:
            problems.append(f"{role}: threads {start.threads} -> {end.threads}")
        if end.rss_kib > start.rss_kib * (1 + rss_growth):
            problems.append(f"{role}: RSS {start.rss_kib / 1024:.0f} -> {end.rss_kib / 1024:.0f} MiB")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL_DIR)
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of traffic")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--sample-every", type=float, default=30.0)
    parser.add_argument("--warm-up", type=float, default=30.0, help="seconds before the reference sample")
    parser.add_argument("--fd-slack", type=int, default=8)
    parser.add_argument("--thread-slack", type=int, default=4)
    parser.add_argument("--rss-growth", type=float, default=0.10)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    log_dir = Path(tempfile.mkdtemp(prefix="pdserve-soak-"))
    spec = ClusterSpec(model_dir=args.model, listen="127.0.0.1:0", attention_backend="torch",
                       worker_args=("--num-threads", "1", "--kv-memory-mb", "128"), log_level="WARNING")
    cluster = Cluster(spec, log_dir=log_dir)
    gateway = cluster.start(timeout_s=600)
    try:
        decode = [child.address for child in cluster.children if child.role.startswith("decode")]
        pids = {child.role: child.process.pid for child in cluster.children}
        idle = asyncio.run(take_sample(time.monotonic(), decode, pids)).free_pages
        print(f"soak: {args.duration:.0f} s, concurrency {args.concurrency}, gateway {gateway}, logs in {log_dir}; "
              f"idle free pages {idle}", flush=True)
        samples, final, counts = asyncio.run(soak(gateway, decode, pids, args.duration, args.concurrency,
                                                  args.sample_every, args.warm_up, args.seed))
    finally:
        cluster.stop()
    print(f"\noutcomes: {dict(sorted(counts.items()))}")
    if not samples:
        print("no sample after warm-up: run longer than --warm-up")
        return 1
    print(f"after warm-up: {format_sample(samples[0])}\nat the end:    {format_sample(final)}")
    problems = flatness(samples[0], final, idle, args.fd_slack, args.thread_slack, args.rss_growth)
    print("FLAT" if not problems else "NOT FLAT:\n  " + "\n  ".join(problems))
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
