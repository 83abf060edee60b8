"""Prefix-aware disaggregation through `pdserve up` (issue 34's benchmark): four deployments of one model side by
side, each 2 prefill + 2 decode workers, measured in turns by `pdserve bench`'s multi-turn workload (conversations
resending their history with the model's real answers, interleaved) over the gateway's gRPC API:

  (a) off        --no-prefix-cache, --cache-routing-weight 0, --disagg-threshold-tokens 0
  (b) caches     engine prefix caches on, load-only routing (weight 0), always a prefill worker (threshold 0)
  (c) routing    (b) with cache-aware routing (the default weight)
  (d) local      (c) with conditional disaggregation (the default threshold: short suffixes prefilled on decode)

Reported per deployment: TTFT p50 / p90 of turns >= 2, the hit rate (cached tokens in usage over the history each
turn resends) and output throughput; the paired per-round ratios against (a). Goals (issue 34): TTFT p50 of turns
>= 2 under (d) <= 1/5 of (a); hit rate >= 90% of achievable under (c) and (d); output throughput (d) >= (a).

    .venv/bin/python -m benchmarks.bench_disagg_up --model models/pdserve-k3-tiny --repeats 5
"""
from __future__ import annotations

import argparse
import asyncio
import io
import logging
import os
from pathlib import Path

from bench.config import BenchConfig, SamplingOptions
from bench.prefix_workloads import ConversationShape
from bench.runner import run_benchmark
from benchmarks.bench_prefix_cache_up import Deployment
from benchmarks.common import Metrics, add_common_arguments, interleave, load_note, paired, print_header, spread

logger = logging.getLogger("bench_disagg_up")
TOPOLOGY = ("--num-prefill", "2", "--num-decode", "2")
CONFIGS = {
    "a": (False, ("--cache-routing-weight", "0", "--disagg-threshold-tokens", "0")),
    "b": (True, ("--cache-routing-weight", "0", "--disagg-threshold-tokens", "0")),
    "c": (True, ("--disagg-threshold-tokens", "0")),
    "d": (True, ()),
}


def measure(address: str, seed: int, args: argparse.Namespace) -> Metrics:
    config = BenchConfig(gateway=address, workload="multi-turn", input_len=args.message_len, output_len=args.answer_len,
                         range_ratio=0.5, seed=seed, concurrencies=(args.concurrency,), warmup_requests=0,
                         progress=False, conversation=ConversationShape(args.conversations, args.turns, args.think_s,
                                                                        args.system_prompt_len))
    [result] = asyncio.run(run_benchmark(config, SamplingOptions(temperature=0.0, timeout_s=600), stdout=io.StringIO()))
    if result["failed"]:
        logger.warning("%d requests failed against %s", result["failed"], address)
    return {"ttft_p50": result["median_ttft_later_turns_ms"] / 1000, "ttft_p90": result["p90_ttft_later_turns_ms"] / 1000,
            "hit_rate": result["cache_hit_rate"] or 0.0, "throughput": result["output_throughput"],
            "failed": result["failed"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(parser, repeats=5)
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=2, help="requests in flight")
    parser.add_argument("--think-s", type=float, default=0.1)
    parser.add_argument("--message-len", type=int, default=128, help="new user tokens per turn (x0.5..1.5)")
    parser.add_argument("--answer-len", type=int, default=32)
    parser.add_argument("--system-prompt-len", type=int, default=512)
    parser.add_argument("--kv-memory-mb", type=int, default=256)
    parser.add_argument("--configs", default="abcd")
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp"))
    args = parser.parse_args()
    print_header("prefix-aware disaggregation through `pdserve up` (2 prefill + 2 decode workers each)", args)
    print(f"workload: {args.conversations} conversations x {args.turns} turns, {args.concurrency} in flight, "
          f"{args.system_prompt_len}-token system prompt, ~{args.message_len}-token messages, {args.answer_len}-token "
          f"answers, think {args.think_s} s; workers --num-threads {args.threads}\n", flush=True)
    deployments: dict[str, Deployment] = {}
    try:
        for name in args.configs:
            cache, extra = CONFIGS[name]
            log = args.log_dir / f"disagg_up_{Path(args.model).name}_{name}_{os.getpid()}.log"
            deployments[name] = Deployment(args.model, cache, args.threads, log,
                                           TOPOLOGY + ("--kv-memory-mb", str(args.kv_memory_mb)) + extra)
        seeds = [args.seed * 1000 + 200 + r for r in range(args.repeats)]
        calls = {name: 0 for name in deployments}

        def variant(name: str):
            def run() -> Metrics:
                seed = seeds[calls[name]]
                calls[name] += 1
                metrics = measure(deployments[name].address, seed, args)
                logger.warning("round %d (%s): %s", calls[name], name, metrics)
                return metrics
            return run

        runs = interleave({name: variant(name) for name in deployments}, args.repeats, warmup=False)
        print("| deployment | TTFT p50 turns >= 2 | TTFT p90 | p50 / (a) | hit rate of achievable | output tok/s | "
              "tok/s / (a) | failed |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for name, samples in runs.items():
            base = "a" in runs and name != "a"
            print(f"| ({name}) | {spread([m['ttft_p50'] for m in samples], 1000, ' ms')} | "
                  f"{spread([m['ttft_p90'] for m in samples], 1000, ' ms')} | "
                  f"{spread(paired(samples, runs['a'], 'ttft_p50'), 100, '%') if base else ''} | "
                  f"{spread([m['hit_rate'] for m in samples], 100, '%')} | {spread([m['throughput'] for m in samples])} | "
                  f"{spread(paired(samples, runs['a'], 'throughput'), 100, '%') if base else ''} | "
                  f"{sum(m['failed'] for m in samples)} |")
        print(f"\nload: {load_note(runs)}")
    finally:
        for deployment in deployments.values():
            deployment.stop()


if __name__ == "__main__":
    main()
