"""The prefix cache through `pdserve up`: two deployments of one model side by side (the prefix cache on, and
`--no-prefix-cache`), each measured in turn by `pdserve bench`'s prefix workloads (bench/prefix_workloads.py) over
the gateway's gRPC API, interleaved rounds with fresh prompts each round (the same for both deployments).

- shared-prefix: --num-prefixes prefixes of 1-4K tokens, --requests requests round robin, suffixes of 16-32
  tokens, one request at a time; TTFT p50 over all requests (the first of each prefix is cold in both).
- multi-turn: --conversations conversations x --turns turns, each turn resending the history (a
  --system-prompt-len system prompt, the earlier messages and the model's real answers of 32 tokens) plus a
  64-256-token message, at most 2 requests in flight; TTFT p50 of turns >= 2.

Hit rate: the cached tokens the gateway reported (usage) over the workload's achievable ones.

    .venv/bin/python -m benchmarks.bench_prefix_cache_up --model models/pdserve-k3-tiny --repeats 5
"""
from __future__ import annotations

import argparse
import asyncio
import io
import logging
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench.config import BenchConfig, SamplingOptions
from bench.prefix_workloads import ConversationShape, SharedPrefixShape
from bench.runner import run_benchmark
from benchmarks.common import Metrics, add_common_arguments, interleave, load_note, paired, print_header, spread

logger = logging.getLogger("bench_prefix_cache_up")


class Deployment:
    """`pdserve up` in a process group of its own; address: its gateway (read from the banner)."""

    def __init__(self, model: Path, cache: bool, threads: int, log_path: Path, extra: tuple[str, ...] = ()) -> None:
        command = [sys.executable, "-m", "pdserve.cli", "up", "--model", str(model), "--listen", "127.0.0.1:0",
                   "--http-listen", "", "--num-threads", str(threads)] + ([] if cache else ["--no-prefix-cache"])
        command += list(extra)
        self._log = open(log_path, "w")
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=self._log, text=True,
                                        start_new_session=True)
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [lines.put(line) for line in self.process.stdout], daemon=True).start()
        deadline = time.monotonic() + 600
        while True:
            if time.monotonic() > deadline or self.process.poll() is not None:
                self.stop()
                raise RuntimeError(f"pdserve up did not come up (see {log_path})")
            try:
                found = re.search(r"pdserve is up: gateway (\S+)", lines.get(timeout=1.0))
            except queue.Empty:
                continue
            if found:
                self.address = found.group(1)
                return

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()


def measure(address: str, workload: str, seed: int, args: argparse.Namespace) -> Metrics:
    if workload == "shared-prefix":
        config = BenchConfig(gateway=address, workload=workload, num_prompts=args.requests, output_len=4,
                             range_ratio=0.5, seed=seed, concurrencies=(1,), warmup_requests=0, progress=False,
                             shared_prefix=SharedPrefixShape(args.num_prefixes, 1024, 4096, 32))
    else:
        config = BenchConfig(gateway=address, workload=workload, input_len=256, output_len=32, range_ratio=0.25,
                             seed=seed, concurrencies=(2,), warmup_requests=0, progress=False,
                             conversation=ConversationShape(args.conversations, args.turns, 0.05,
                                                            args.system_prompt_len))
    [result] = asyncio.run(run_benchmark(config, SamplingOptions(temperature=0.0, timeout_s=600), stdout=io.StringIO()))
    if result["failed"]:  # counted and printed; the figures are over the completed requests
        logger.warning("%d requests failed against %s", result["failed"], address)
    key = "median_ttft_later_turns_ms" if workload == "multi-turn" else "median_ttft_ms"
    p90 = "p90_ttft_later_turns_ms" if workload == "multi-turn" else "p90_ttft_ms"
    return {"ttft_p50": result[key] / 1000, "ttft_p90": result[p90] / 1000, "hit_rate": result["cache_hit_rate"] or 0.0,
            "cached": result["mean_cached_tokens"] or 0.0, "failed": result["failed"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(parser, repeats=5)
    parser.add_argument("--workloads", default="shared-prefix,multi-turn")
    parser.add_argument("--num-prefixes", type=int, default=2)
    parser.add_argument("--requests", type=int, default=6)
    parser.add_argument("--conversations", type=int, default=3)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-prompt-len", type=int, default=0)
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp"))
    args = parser.parse_args()
    print_header("prefix cache through `pdserve up`: on vs --no-prefix-cache", args)
    print(f"workers: --num-threads {args.threads} each (one prefill + one decode worker per deployment)\n", flush=True)
    deployments = {}
    try:
        for name, cache in (("on", True), ("off", False)):
            log = args.log_dir / f"prefix_up_{Path(args.model).name}_{name}_{os.getpid()}.log"
            deployments[name] = Deployment(args.model, cache, args.threads, log)
        for workload in args.workloads.split(","):
            seeds = [args.seed * 1000 + (100 if workload == "multi-turn" else 0) + r for r in range(args.repeats)]
            calls = {"on": 0, "off": 0}

            def variant(name: str, workload: str = workload, seeds: list[int] = seeds):
                def run() -> Metrics:
                    seed = seeds[calls[name]]
                    calls[name] += 1
                    metrics = measure(deployments[name].address, workload, seed, args)
                    logger.warning("%s round %d %s: %s", workload, calls[name], name, metrics)
                    return metrics
                return run

            runs = interleave({"off": variant("off"), "on": variant("on")}, args.repeats, warmup=False)
            ratio = paired(runs["on"], runs["off"], "ttft_p50")
            which = "turns >= 2" if workload == "multi-turn" else "all requests"
            print(f"## {workload} (TTFT of {which})\n")
            for stat in ("ttft_p50", "ttft_p90"):
                print(f"{stat} off: {spread([m[stat] for m in runs['off']], 1000, ' ms')}; "
                      f"on: {spread([m[stat] for m in runs['on']], 1000, ' ms')}  ")
            print(f"p50 on / off (paired rounds): {spread(ratio, 100, '%')} (goal <= 20%)  ")
            print(f"hit rate of achievable: on {spread([m['hit_rate'] for m in runs['on']], 100, '%')}, "
                  f"off {spread([m['hit_rate'] for m in runs['off']], 100, '%')}; mean cached tokens per request on "
                  f"{spread([m['cached'] for m in runs['on']])}  ")
            failed = {name: sum(m["failed"] for m in runs[name]) for name in runs}
            print(f"failed requests: on {failed['on']}, off {failed['off']}; load: {load_note(runs)}\n", flush=True)
    finally:
        for deployment in deployments.values():
            deployment.stop()


if __name__ == "__main__":
    main()
