"""Decode protected from prefill on a CPU node: `pdserve up` with its prefill and decode workers on disjoint cores
(the default, --cpu-split) against the same deployment with every worker on every core (--no-cpu-split), both
up at once and taking turns, through the gateway's OpenAI HTTP API with the client of benchmarks/peer_vllm.py.

Model: the DeepSeek-V3-geometry checkpoint of peer_vllm (written once under ~/.cache/pdserve-peer), or --model.
Per round and deployment: a closed loop at each --concurrency (default 16, then 1) of random --input-len-token
prompts, --output-len tokens, greedy, ignore_eos, fresh prompts every round (the same for both deployments).
Reported: median (min..max) over --rounds of output tok/s, TTFT p50, TPOT p50, ITL p99 and ITL p99 / TPOT p50 (the issue's goal: <= 2 at c=16), the per-round split / shared
ratio, the load. Each deployment's `pdserve up` flags: --split-args / --shared-args (default "--no-cpu-split");
--names relabels the two (e.g. core lending on vs off: --names lending no-lending --shared-args=--no-core-lending).

Run: .venv/bin/python -m benchmarks.bench_cpu_split [--rounds 5] [--concurrency 16 1] [--model DIR]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shlex
import tempfile
from pathlib import Path

from bench.workload import random_requests
from benchmarks.common import Table, cpu_flags, machine_description, spread
from benchmarks.peer_servers import CACHE_DIR, Server, exit_on_sigterm, start_pdserve, write_peer_checkpoint
from benchmarks.peer_vllm import SPECIAL_IDS, model_id, ratio_spread, run_workload

METRICS = (("output tok/s", "output_throughput"), ("TTFT p50 ms", "median_ttft_ms"), ("TPOT p50 ms", "median_tpot_ms"),
           ("ITL p99 ms", "p99_itl_ms"), ("ITL p99 / TPOT p50", "itl_over_tpot"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="default: peer_vllm's DeepSeek-V3-geometry checkpoint")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16, 1])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--prompts-per-slot", type=int, default=3)
    parser.add_argument("--split-args", default="", help="`pdserve up` flags of the first deployment")
    parser.add_argument("--shared-args", default="--no-cpu-split", help="`pdserve up` flags of the second one")
    parser.add_argument("--names", nargs=2, default=["split", "shared"], help="the two deployments' labels")
    parser.add_argument("--log-dir", type=Path, default=None)
    args = parser.parse_args()
    first, second = variants = tuple(args.names)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    print("# bench_cpu_split: prefill and decode workers on disjoint cores vs shared cores (`pdserve up`)\n")
    print(f"machine: {machine_description()}  \nCPU flags: {cpu_flags()}\n", flush=True)
    model = args.model or CACHE_DIR / "dsv3-peer-83m"
    if args.model is None:
        write_peer_checkpoint(model)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="pdserve-split-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    servers: dict[str, Server] = {}
    exit_on_sigterm()
    try:
        servers[first] = start_pdserve(model, log_dir / f"{first}.log", shlex.split(args.split_args))
        servers[second] = start_pdserve(model, log_dir / f"{second}.log", shlex.split(args.shared_args))
        for server in servers.values():
            server.wait_ready(900)
        models = {name: model_id(server.base_url) for name, server in servers.items()}
        def loads_of(round_index: int) -> list:  # fresh prompts every round (-1: the warm-up): no prefix-cache hits
            return [(c, random_requests(max(args.prompts_per_slot * c, 4), args.input_len, args.output_len, vocab,
                                        SPECIAL_IDS, seed=c + 10_000 * (round_index + 1))) for c in args.concurrency]

        loads = loads_of(-1)
        for concurrency, requests in loads:  # warm-up, unrecorded
            for name in variants:
                asyncio.run(run_workload(servers[name].base_url, models[name], requests[:concurrency], concurrency))
        results: dict[int, dict[str, list[dict[str, float]]]] = {c: {v: [] for v in variants} for c, _ in loads}
        for round_index in range(args.rounds):
            order = variants if round_index % 2 == 0 else tuple(reversed(variants))
            for concurrency, requests in loads_of(round_index):
                for name in order:
                    metrics = asyncio.run(run_workload(servers[name].base_url, models[name], requests, concurrency))
                    metrics["itl_over_tpot"] = metrics["p99_itl_ms"] / metrics["median_tpot_ms"]
                    results[concurrency][name].append(metrics)
                    logging.info("round %d c=%d %s: %.1f tok/s, TPOT p50 %.1f ms, ITL p99 %.0f ms (load %.1f)",
                                 round_index + 1, concurrency, name, metrics["output_throughput"],
                                 metrics["median_tpot_ms"], metrics["p99_itl_ms"], metrics["load"])
        table = Table(f"`pdserve up` on {model.name}: {first} ({args.split_args or 'defaults'}) vs {second} ({args.shared_args}), {args.input_len}+{args.output_len} tokens, "
                      f"median (min..max) of {args.rounds} interleaved rounds",
                      ["concurrency", "metric", first, second, f"{first} / {second}", "load"])
        for concurrency, by_variant in results.items():
            loads_seen = [m["load"] for samples in by_variant.values() for m in samples]
            others = [m["other_cores"] for samples in by_variant.values() for m in samples]
            load_text = f"{min(loads_seen):.1f}..{max(loads_seen):.1f}; others <= {max(others):.2f} cores"
            for title, key in METRICS:
                ratios = [s[key] / h[key] for s, h in zip(by_variant[first], by_variant[second]) if h[key]]
                table.add(concurrency, title, spread([m[key] for m in by_variant[first]]),
                          spread([m[key] for m in by_variant[second]]), ratio_spread(ratios), load_text)
        print()
        table.print()
        print(f"load average at the end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    finally:
        for server in servers.values():
            server.stop()


if __name__ == "__main__":
    main()
