"""CPU cost of each hop of one request through the services at concurrency 1 (issue 18, items 2 and 3).

Starts 1 prefill + 1 decode worker and the gateway (TP 1, shm, torch attention, as bench_gateway does) and
sends greedy requests one at a time with three output lengths, reading every thread's CPU time from
/proc/<pid>/task before and after each batch. The differences split one request into hops by CPU, which
a loaded machine does not distort the way it distorts wall clock:
  1 token    the first-token path: gateway routing, Reserve, Prefill (queue, forward, KV handoff), first
             token out; the gateway then Releases the unclaimed lease (one extra RPC on this path only).
  2 tokens   + the Decode call: claim, KV admission (completion records, checksum), engine admission and
             one decode step; no Release.
  N tokens   + N-2 decode steps: (N - 2 tokens) / (N - 2) is the decode worker's CPU per streamed token.
Also counts the decode engine's steps (its /metrics), so per-token figures are per step at concurrency 1.

The decode worker runs its engine in a process of its own: that process's threads show as decode-engine/engine
(the step loop) and decode-engine/loop (its command thread).

Run: .venv/bin/python -m benchmarks.profile_hops [--model DIR] [--requests 24] [--output-len 64]
Needs py-spy (the dev extra) to name the services' Python threads.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import os
import tempfile
from pathlib import Path

import grpc
import psutil

from bench.client import GatewayClient, SamplingOptions
from bench.workload import BenchRequest
from benchmarks.common import DEFAULT_MODEL, machine_description, make_prompts
from benchmarks.profile_services import find_py_spy, python_thread_names
from engine.models.registry import load_config
from pdserve.launcher import Cluster, ClusterSpec

Usage = dict[str, dict[str, tuple[float, float, float]]]  # role -> thread -> (CPU s, times scheduled, faults)
METRICS = ("CPU ms", "times scheduled in", "minor page faults")


def thread_usage(pid: int, names: dict[int, str]) -> dict[str, tuple[float, float, float]]:
    """Per thread name: CPU seconds at nanosecond resolution and the times the thread was put on a CPU
    (/proc/<pid>/task/<tid>/schedstat: /proc's stat counts CPU in 10 ms ticks), and its minor page faults."""
    totals: dict[str, tuple[float, float, float]] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            runtime, _, scheduled = map(int, (task / "schedstat").read_text().split()[:3])
            stat = (task / "stat").read_text()
        except OSError:
            continue  # the thread ended meanwhile
        name = names.get(int(task.name)) or "os:" + stat[stat.index("(") + 1 : stat.rindex(")")]
        faults = int(stat[stat.rindex(")") + 2 :].split()[7])
        old = totals.get(name, (0.0, 0.0, 0.0))
        totals[name] = (old[0] + runtime / 1e9, old[1] + scheduled, old[2] + faults)
    return totals


def snapshot(pids: dict[str, int], names: dict[str, dict[int, str]]) -> Usage:
    return {role: thread_usage(pid, names[role]) for role, pid in pids.items()}


def per_request(before: Usage, after: Usage, requests: int) -> list[collections.Counter[str]]:
    """For each of METRICS: role/thread group (engine, event loop, gRPC, other) -> amount per request."""
    out: list[collections.Counter[str]] = [collections.Counter() for _ in METRICS]
    for role, threads in after.items():
        for name, values in threads.items():
            old = before[role].get(name, (0.0, 0.0, 0.0))
            for index, (new, previous) in enumerate(zip(values, old)):
                scale = 1e3 if index == 0 else 1.0
                out[index][f"{role}/{thread_group(name)}"] += scale * (new - previous) / requests
    return out


def thread_group(name: str) -> str:
    if name.endswith("-engine"):
        return "engine"
    if name == "MainThread":
        return "loop"
    if name in ("os:event_engine", "Thread-2 (_poll_wrapper)") or "grpc" in name:
        return "grpc"
    return "other"


def engine_process(decode_pid: int) -> int:
    """The decode worker's engine process: its multiprocessing child that is not the resource tracker."""
    for child in psutil.Process(decode_pid).children():
        command = " ".join(child.cmdline())
        if "spawn_main" in command and "resource_tracker" not in command:
            return child.pid
    raise RuntimeError(f"decode worker {decode_pid} has no engine process")


async def send_all(address: str, prompts: list[list[int]], output_len: int) -> int:
    channel = grpc.aio.insecure_channel(address)
    client = GatewayClient(channel, SamplingOptions(temperature=0.0, speculative=False))
    tokens = 0
    try:
        for prompt in prompts:
            record = await client.send(BenchRequest(output_len=output_len, ignore_eos=True, token_ids=tuple(prompt)))
            if not record.success:
                raise RuntimeError(f"request failed: {record.error}")
            tokens += record.output_tokens
    finally:
        await channel.close()
    return tokens


def table(rows: dict[str, dict[str, float]], columns: list[str]) -> str:
    keys = sorted({key for row in rows.values() for key in row})
    lines = ["| process/thread | " + " | ".join(columns) + " |", "|---|" + "---:|" * len(columns)]
    for key in keys:
        lines.append(f"| {key} | " + " | ".join(f"{rows[c].get(key, 0.0):.3f}" for c in columns) + " |")
    lines.append("| total | " + " | ".join(f"{sum(rows[c].values()):.3f}" for c in columns) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--requests", type=int, default=24, help="requests per output length")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds (the table sums them)")
    args = parser.parse_args()
    if args.output_len < 3:
        parser.error("--output-len must be at least 3")
    py_spy = find_py_spy()
    print(f"machine: {machine_description()}", flush=True)
    spec = ClusterSpec(model_dir=str(args.model), listen="127.0.0.1:0", attention_backend="torch", transport="shm",
                       worker_args=("--num-threads", str(args.threads), "--kv-memory-mb", "512"), log_level="WARNING")
    cluster = Cluster(spec, log_dir=Path(tempfile.mkdtemp(prefix="profile-hops-")))
    address = cluster.start(timeout_s=300)
    try:
        config = load_config(str(args.model))
        prompts, _ = make_prompts(args.model, args.requests, args.input_len, 0, config.vocab_size,
                                  list(config.eos_token_id))
        pids = {child.role.split("-")[0]: child.process.pid for child in cluster.children}
        pids["decode-engine"] = engine_process(pids["decode"])
        asyncio.run(send_all(address, prompts[:4], 8))  # warm-up
        names = {role: python_thread_names(py_spy, pid) for role, pid in pids.items()}
        lengths = [1, 2, args.output_len]
        totals = {n: [collections.Counter() for _ in METRICS] for n in lengths}
        for _ in range(args.rounds):
            for length in lengths:
                before = snapshot(pids, names)
                asyncio.run(send_all(address, prompts, length))
                for total, part in zip(totals[length], per_request(before, snapshot(pids, names),
                                                                   args.requests * args.rounds)):
                    total.update(part)
        print(f"\nper request by process/thread ({args.requests} x {args.rounds} requests per column, "
              f"{args.input_len} prompt tokens; load average {os.getloadavg()[0]:.1f} at the end)")
        for index, metric in enumerate(METRICS):
            rows = {f"{n} tok": dict(totals[n][index]) for n in lengths}
            rows["decode set-up"] = {k: rows["2 tok"].get(k, 0.0) - rows["1 tok"].get(k, 0.0) for k in rows["2 tok"]}
            rows["per token"] = {k: (v - rows["2 tok"].get(k, 0.0)) / (args.output_len - 2)
                                 for k, v in rows[f"{args.output_len} tok"].items()}
            print(f"\n{metric}\n{table(rows, list(rows))}")
    finally:
        cluster.stop()


if __name__ == "__main__":
    main()
