"""Through the gateway vs in process, in one run (issue 6; issue 7 (a) and (b)).

Launches 1 prefill + 1 decode worker (TP 1, shm KV transport, torch attention, the model's draft) and the
gateway on loopback, and an in-process LLM over the same model with the same engine settings. Both serve the
same prompts (held-out Python token ids, fixed input/output lengths, greedy, ignore eos):
  overhead   speculation off. Gateway: gRPC streaming client (bench.client.GatewayClient, the one
             `pdserve bench` uses) over one warm channel, closed loop at concurrency C. In process: the
             same prompts in consecutive groups of C through the engine's step loop. Output tok/s and TTFT
             p50 (gateway: send -> first streamed token; in process: add_request -> the step that
             produced the first token).
  spec       speculation on vs off at concurrency 1, 4, 16, 64, through the gateway and in process, on the
             held-out prompt set of benchmarks/prompts.py (at least its 16 prompts of 8 kinds per run).
Variants take turns; medians of --repeats (default 5); ratios and added TTFT are taken per round and shown as
median (min..max), with the load averages the runs ended at. The CPU table sets the decode worker's CPU per
output token against the in-process engine's (all steps, as issue 18 states the goal, and decode steps only:
the decode worker runs no prefill). Goals (issue 18): gateway >= 95% of in-process throughput at
concurrency 16 and >= 85% at 1, <= 5 ms added TTFT p50 at 1, decode worker CPU per token <= 1.1x. A worker's
CPU counts its descendants too (the decode worker's engine process and TP followers).

--standing-lease-tokens N adds a deployment like the first whose gateway runs with --standing-lease-tokens N (a
standing lease of N prompt tokens per decode worker, gateway/standing_leases.py: no Reserve round trip before a
fitting prompt's prefill; 0: none), to compare with the gateway's default. --baseline DIR adds the same
deployment run from another checkout (DIR/.venv/bin/python, DIR's code: e.g. main beside a branch), taking turns
with the others in the same run.

Run: .venv/bin/python -m benchmarks.bench_gateway --threads 1 [--spec-concurrency] [--stream-interval N]
     [--standing-lease-tokens N] [--baseline DIR]
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import grpc

from bench.client import GatewayClient, SamplingOptions
from bench.load import LoadPlan, run_load
from bench.metrics import compute_metrics
from bench.workload import BenchRequest
from benchmarks.common import (Metrics, Table, add_common_arguments, goal_line, interleave, load_note, make_prompts,
                               median, most_other_load, paired, print_header, ratio, spread, timed_groups,
                               tree_cpu_seconds)
from benchmarks.prompts import DEFAULT_COUNT, held_out_prompts
from engine import LLM, SamplingParams
from pdserve.launcher import Cluster, ClusterSpec


# A run is judged when processes outside the benchmark used at most this many cores' worth of CPU meanwhile.
OTHER_LOAD_LIMIT = 0.25

class BaselineCluster:
    """The deployment of `spec`, run from another checkout by a child process (DIR/.venv/bin/python, cwd DIR) that
    holds a pdserve.launcher.Cluster there: its gateway address and process ids, for GatewayRunner. stop() ends
    it (the child stops the cluster when its stdin closes)."""

    SCRIPT = """
import json, sys
from pathlib import Path
from pdserve.launcher import Cluster, ClusterSpec
fields = {k: tuple(v) if isinstance(v, list) else v for k, v in json.loads(sys.argv[1]).items()}
cluster = Cluster(ClusterSpec(**fields), log_dir=Path(sys.argv[2]))
address = cluster.start(timeout_s=300)
print(json.dumps({"address": address, "pids": {c.role.split("-")[0]: c.process.pid for c in cluster.children}}), flush=True)
sys.stdin.read()
cluster.stop()
"""

    def __init__(self, checkout: Path, spec: ClusterSpec, log_dir: Path) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}  # (nothing written into the other checkout)
        self.process = subprocess.Popen(
            [str(checkout / ".venv" / "bin" / "python"), "-c", self.SCRIPT, json.dumps(dataclasses.asdict(spec)),
             str(log_dir)], cwd=checkout, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the baseline deployment from {checkout} did not start (logs in {log_dir})")
        started = json.loads(line)
        self.address: str = started["address"]
        self.pids: dict[str, int] = started["pids"]

    def stop(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait(120)


def request_count(concurrency: int) -> int:
    """Requests per run: two waves at concurrency C, at least 16 (TTFT p50 at concurrency 1 is a median over the
    run's requests: with a few, one slow forward moves it), at most 64."""
    return min(max(2 * concurrency, 16), max(64, concurrency))


class GatewayRunner:
    """One event loop and one warm channel to the gateway, reused by every run."""

    def __init__(self, address: str, pids: dict[str, int]) -> None:
        self.loop = asyncio.new_event_loop()
        self.channel = self.loop.run_until_complete(self._connect(address))
        self.pids = pids  # role -> process id, for CPU accounting

    @staticmethod
    async def _connect(address: str) -> grpc.aio.Channel:
        channel = grpc.aio.insecure_channel(address)
        await GatewayClient(channel).model_info(address, 60.0)
        return channel

    def run(self, prompts: list[list[int]], output_len: int, concurrency: int, speculative: bool,
            stream_interval: int | None = None) -> Metrics:
        """Also reports each process's CPU milliseconds per output token (cpu_<role>, the client included)."""
        before = {role: tree_cpu_seconds(pid) for role, pid in self.pids.items()}
        client_before = time.process_time()
        metrics = self.loop.run_until_complete(self._run(prompts, output_len, concurrency, speculative, stream_interval))
        tokens = metrics.pop("tokens")
        metrics["cpu_client"] = 1e3 * (time.process_time() - client_before) / tokens
        for role, pid in self.pids.items():
            metrics[f"cpu_{role}"] = 1e3 * (tree_cpu_seconds(pid) - before[role]) / tokens
        return metrics

    async def _run(self, prompts, output_len, concurrency, speculative, stream_interval) -> Metrics:
        client = GatewayClient(self.channel, SamplingOptions(temperature=0.0, speculative=speculative,
                                                             stream_interval=stream_interval))
        requests = [BenchRequest(output_len=output_len, ignore_eos=True, token_ids=tuple(p)) for p in prompts]
        outcome = await run_load(requests, client.send, LoadPlan(max_concurrency=concurrency))
        failed = [r.error for r in outcome.records if not r.success]
        if failed:
            raise RuntimeError(f"{len(failed)} gateway requests failed, first: {failed[0]}")
        metrics = compute_metrics(outcome.records, outcome.duration_s)
        result = {"tok_s": metrics.output_throughput, "tokens": metrics.total_output_tokens,
                  "ttft_ms": metrics.ttft_ms.median or float("nan"),
                  "tpot_ms": metrics.tpot_ms.median or float("nan")}
        spec = [(r.output_tokens - 1, r.accept_length) for r in outcome.records
                if r.accept_length and r.output_tokens > 1]
        if spec:  # pooled over verify steps, as in process: decode tokens / verify steps
            result["accept_len"] = sum(n for n, _ in spec) / sum(n / length for n, length in spec)
        return result

    def close(self) -> None:
        self.loop.run_until_complete(self.channel.close())
        self.loop.close()


def in_process(llm: LLM, prompts: list[list[int]], output_len: int, concurrency: int,
               speculative: bool = False) -> Metrics:
    """The prompts in consecutive groups of `concurrency`; with the acceptance length of this run's verify steps."""
    params = SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True, speculative=speculative)
    stats = llm.acceptance_stats
    steps, accepted = stats.num_verify_steps, stats.num_accepted_drafts
    cpu = time.process_time()
    run = timed_groups(llm.engine, prompts, params, concurrency)
    metrics = run.metrics()
    metrics["cpu_in_process"] = 1e3 * (time.process_time() - cpu) / run.new_tokens
    if stats.num_verify_steps > steps:
        metrics["accept_len"] = 1 + (stats.num_accepted_drafts - accepted) / (stats.num_verify_steps - steps)
    return metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_arguments(parser, repeats=5)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--overhead-concurrency", type=int, nargs="*", default=[1, 16],
                        help="concurrencies of the gateway-vs-in-process table (none: skip it)")
    parser.add_argument("--spec-concurrency", type=int, nargs="*", default=[1, 4, 16, 64],
                        help="concurrencies of the speculation table (none: skip it)")
    parser.add_argument("--kv-memory-mb", type=int, default=512)
    parser.add_argument("--stream-interval", type=int, default=1,
                        help="> 1: also run the gateway with GenerateRequest.stream_interval N (chunks of N tokens)")
    parser.add_argument("--log-dir", type=Path, default=None, help="worker logs (default: a temporary folder)")
    parser.add_argument("--baseline", type=Path, default=None, metavar="DIR",
                        help="also run the first deployment from the checkout DIR (its .venv and code), taking turns")
    parser.add_argument("--standing-lease-tokens", type=int, default=None, metavar="N",
                        help="one more deployment, like the first, whose gateway runs with --standing-lease-tokens N "
                             "(0: without standing leases), taking turns with the others")
    args = parser.parse_args()
    if args.quick:
        args.repeats = 1
        args.spec_concurrency = [c for c in args.spec_concurrency if c <= 16]
    print_header("bench_gateway: through the gateway vs in process", args)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="bench-gateway-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    worker_args = ("--num-threads", str(args.threads), "--kv-memory-mb", str(args.kv_memory_mb))
    clusters: dict[str, Cluster] = {}
    gateways: dict[str, GatewayRunner] = {}
    try:
        deployments: list[tuple[str, tuple[str, ...], tuple[str, ...]]] = [("gateway", (), ())]
        baseline: BaselineCluster | None = None
        if args.standing_lease_tokens is not None:
            first_name, first_decode_args, _ = deployments[0]
            label = (f"standing lease {args.standing_lease_tokens}" if args.standing_lease_tokens
                     else "no standing lease")
            deployments.append((f"{first_name}, {label}", first_decode_args,
                                ("--standing-lease-tokens", str(args.standing_lease_tokens))))
        for name, decode_args, gateway_args in deployments:
            spec = ClusterSpec(model_dir=str(args.model), listen="127.0.0.1:0", attention_backend="torch",
                               transport="shm", worker_args=worker_args, decode_args=decode_args, log_level="WARNING",
                               gateway_args=gateway_args)
            cluster_logs = log_dir / name.replace(", ", "-").replace(" ", "-")
            cluster_logs.mkdir(exist_ok=True)
            cluster = clusters[name] = Cluster(spec, log_dir=cluster_logs)
            address = cluster.start(timeout_s=300)
            gateways[name] = GatewayRunner(address, {child.role.split("-")[0]: child.process.pid
                                                     for child in cluster.children})
            print(f"{name}: gateway {address}, 1 prefill + 1 decode worker {decode_args or ''} (TP 1, shm, torch "
                  f"attention, {args.threads} threads each), logs in {log_dir}\n", flush=True)
            if args.baseline is not None and baseline is None:  # the first deployment, from the other checkout
                baseline = BaselineCluster(args.baseline, spec, log_dir / "baseline")
                gateways[f"baseline {args.baseline.name}"] = GatewayRunner(baseline.address, baseline.pids)
                print(f"baseline {args.baseline.name}: the same deployment run from {args.baseline}, gateway "
                      f"{baseline.address}\n", flush=True)
        llm = LLM(str(args.model), attention_backend="torch", num_threads=args.threads,
                  kv_memory_bytes=args.kv_memory_mb * 2**20)
        try:
            config = llm.model_config
            count = max((request_count(c) for c in args.overhead_concurrency + args.spec_concurrency), default=0)
            prompts, source = make_prompts(args.model, count, args.input_len, args.seed, config.vocab_size,
                                           list(config.eos_token_id))
            print(f"prompts: {source}, {args.input_len} tokens in, {args.output_len} out\n", flush=True)
            overhead = bench_overhead(args, llm, gateways, prompts, source) if args.overhead_concurrency else []
            if not args.spec_concurrency:
                print("spec: skipped (--spec-concurrency with no values)\n")
            elif llm.engine.has_draft:
                bench_spec(args, llm, next(iter(gateways.values())))
            else:
                print("spec: the model has no draft; skipped\n")
        finally:
            llm.close()
    finally:
        for gateway in gateways.values():
            gateway.close()
        for cluster in clusters.values():
            cluster.stop()
        if baseline is not None:
            baseline.stop()
    print("## Goals\n")
    for line in overhead:
        print(f"- {line}")


def bench_overhead(args, llm: LLM, gateways: dict[str, GatewayRunner], prompts, source) -> list[str]:
    """Gateway vs in process at each concurrency, for each deployment in gateways (and, with --stream-interval
    N > 1, the first one with chunks of N tokens). Ratios and added TTFT are per round (runs that took turns),
    shown as median (min..max)."""
    table = Table(f"gateway vs in process, speculation off, {args.input_len} in / {args.output_len} out ({source}); "
                  f"{args.repeats} interleaved rounds, median (min..max) of per-round figures",
                  ["concurrency", "variant", "requests", "in-process tok/s", "variant tok/s", "variant / in-process",
                   "in-process TTFT p50 ms", "variant TTFT p50 ms", "added TTFT p50 ms", "load average"])
    cpu = Table("CPU milliseconds per output token in the runs above (user + system, all threads of each process; "
                "in process: all steps, and decode steps only, the engine thread's CPU)",
                ["concurrency", "variant", "in process", "in process, decode steps", "bench client", "gateway",
                 "prefill worker", "decode worker", "decode worker / in process", "decode worker / in-process decode"])
    first = next(iter(gateways))
    variants = {name: (gateway, None) for name, gateway in gateways.items()} | (
        {f"{first}, stream_interval {args.stream_interval}": (gateways[first], args.stream_interval)}
        if args.stream_interval > 1 else {})
    goals = []
    for concurrency in args.overhead_concurrency:
        batch = prompts[: request_count(concurrency)]
        runs = interleave({"in-process": lambda: in_process(llm, batch, args.output_len, concurrency)} | {
            name: (lambda gateway=gateway, interval=interval: gateway.run(
                batch, args.output_len, concurrency, speculative=False, stream_interval=interval))
            for name, (gateway, interval) in variants.items()}, args.repeats)
        local = runs["in-process"]
        for name in variants:
            remote = runs[name]
            throughput = paired(remote, local, "tok_s")
            added = paired(remote, local, "ttft_ms", combine=lambda a, b: a - b)
            table.add(concurrency, name, len(batch), median(local, "tok_s"), median(remote, "tok_s"),
                      spread(throughput, 100, "%"), median(local, "ttft_ms"), median(remote, "ttft_ms"), spread(added),
                      load_note({"in-process": local, name: remote}))
            roles = {role: median(remote, f"cpu_{role}") for role in ("gateway", "prefill", "decode")}
            all_steps, decode_steps = median(local, "cpu_in_process"), median(local, "decode_cpu_ms_per_token")
            cpu.add(concurrency, name, all_steps, decode_steps, median(remote, "cpu_client"), *roles.values(),
                    f"{ratio(roles['decode'], all_steps):.2f}x", f"{ratio(roles['decode'], decode_steps):.2f}x")
            if name not in gateways:
                continue
            goals.append(goal_line(f"{name}: decode worker CPU per output token / in process at concurrency "
                                   f"{concurrency}", ratio(roles["decode"], all_steps), 1.1, higher_is_better=False))
            if name != first:
                continue
            # Judged only when nothing outside the benchmark competed for the CPU: the load average counts the
            # deployment's own processes, which load a 2-core machine above 2 by themselves at concurrency 16.
            others = most_other_load({"in-process": local, name: remote})
            loaded = others > OTHER_LOAD_LIMIT
            wall = []
            if concurrency in (1, 16):
                target = 95.0 if concurrency == 16 else 85.0
                wall.append(goal_line(f"gateway throughput / in-process at concurrency {concurrency} (median of "
                                      f"{len(throughput)} rounds)", 100 * statistics.median(throughput), target,
                                      unit="%"))
            if concurrency == 1:
                wall.append(goal_line("added TTFT p50 at concurrency 1", statistics.median(added), 5.0, unit=" ms",
                                      higher_is_better=False))
            # When other work takes the cores, the in-process engine (one thread) and the services (four
            # processes) get different shares of them: wall-clock ratios then say nothing about overhead.
            goals += [f"{line} - NOT JUDGED: other processes used up to {others:.2f} cores during a run" if loaded
                      else line for line in wall]
    table.print()
    cpu.print()
    return goals


def spec_request_count(concurrency: int) -> int:
    """Requests per speculation run: the whole held-out set (benchmarks/prompts.py) at least."""
    return max(request_count(concurrency), DEFAULT_COUNT)


def bench_spec(args, llm: LLM, gateway: GatewayRunner) -> None:
    """Speculation on vs off, gateway and in process, on the held-out prompt set bench_spec and bench_k3_spec use."""
    config = llm.model_config
    prompts, source = held_out_prompts(args.model, max(spec_request_count(c) for c in args.spec_concurrency),
                                       args.input_len, config.vocab_size, list(config.eos_token_id), args.seed)
    prompts = [p.token_ids for p in prompts]
    table = Table(f"speculative decoding on vs off, greedy, {args.input_len} in / {args.output_len} out ({source})",
                  ["concurrency", "requests", "gateway off tok/s", "gateway on tok/s", "gateway speed-up",
                   "gateway accept len", "in-process off tok/s", "in-process on tok/s", "in-process speed-up",
                   "in-process accept len", "gateway TPOT p50 off / on ms", "load"])
    for concurrency in args.spec_concurrency:
        batch = prompts[: spec_request_count(concurrency)]
        runs = interleave({
            "gateway off": lambda: gateway.run(batch, args.output_len, concurrency, speculative=False),
            "gateway on": lambda: gateway.run(batch, args.output_len, concurrency, speculative=True),
            "in-process off": lambda: in_process(llm, batch, args.output_len, concurrency, speculative=False),
            "in-process on": lambda: in_process(llm, batch, args.output_len, concurrency, speculative=True),
        }, args.repeats)
        rate = {name: median(samples, "tok_s") for name, samples in runs.items()}
        table.add(concurrency, len(batch), rate["gateway off"], rate["gateway on"],
                  f"{ratio(rate['gateway on'], rate['gateway off']):.2f}x", median(runs["gateway on"], "accept_len"),
                  rate["in-process off"], rate["in-process on"],
                  f"{ratio(rate['in-process on'], rate['in-process off']):.2f}x",
                  median(runs["in-process on"], "accept_len"),
                  f"{median(runs['gateway off'], 'tpot_ms'):.2f} / {median(runs['gateway on'], 'tpot_ms'):.2f}",
                  load_note(runs))
    table.print()


if __name__ == "__main__":
    main()
