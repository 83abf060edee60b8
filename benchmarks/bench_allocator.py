"""Engine steps with freed host memory retained (engine/runtime/host_memory.py, the default) against glibc's
defaults (PDSERVE_RETAIN_FREED_MEMORY=0): two engine processes on the same checkpoint, one per setting (the
setting is per process), running the same step plans while the other waits, taking turns over --repeats rounds.

Steps (the shapes of a decode worker at c=16 in benchmarks/peer_vllm.py): a decode step of --batch sequences
(--context cached tokens each), a prefill step of --chunk tokens, and the mixed step carrying both. Reported per
step: each setting's median (min..max) ms, the per-round ratio retained / defaults, and each process's minor page
faults per step.

Model: peer_vllm's DeepSeek-V3-geometry checkpoint (written once under ~/.cache/pdserve-peer), or --model.

Run: .venv/bin/python -m benchmarks.bench_allocator [--repeats 9] [--threads 2]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.bench_mixed_step import step_arguments, step_plans
from benchmarks.common import REPO_ROOT, print_header, spread
from benchmarks.peer_servers import CACHE_DIR, write_peer_checkpoint

SETTINGS = {"retained": "1", "defaults": "0"}
STEPS = ("decode", "prefill", "mixed")


def child(args: argparse.Namespace) -> None:
    """Builds the engine and the plans, then runs the step named on each stdin line; answers ms and faults."""
    from engine import LLM

    with LLM(str(args.model), draft_model="", page_size=16, max_running=max(32, args.batch), prefix_cache=False,
             num_threads=args.threads) as llm:
        engine = llm.engine
        plans = step_plans(engine, args)
        print("ready", flush=True)
        for line in sys.stdin:
            plan = plans[line.strip()]
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            started = time.perf_counter()
            engine.leader.execute(plan)
            elapsed = (time.perf_counter() - started) * 1000
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
            print(json.dumps({"ms": elapsed, "faults": faults}), flush=True)


def main() -> None:
    parser = step_arguments(__doc__, repeats=9)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.repeats = 2
    if args.model is None:
        args.model = CACHE_DIR / "dsv3-peer-83m"
        if not args.child:
            write_peer_checkpoint(Path(args.model), args.seed)
    if args.child:
        child(args)
        return
    print_header("Engine steps with freed host memory retained vs glibc's defaults (two processes, taking turns)", args)
    command = [sys.executable, "-m", "benchmarks.bench_allocator", "--child", "--model", str(args.model),
               "--threads", str(args.threads), "--batch", str(args.batch), "--context", str(args.context),
               "--chunk", str(args.chunk), "--seed", str(args.seed)]
    children = {name: subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT,
                                       env={**os.environ, "PDSERVE_RETAIN_FREED_MEMORY": value})
                for name, value in SETTINGS.items()}
    try:
        for name, process in children.items():
            if process.stdout.readline().strip() != "ready":
                raise SystemExit(f"the {name} engine did not start")

        def run(name: str, step: str) -> dict[str, float]:
            process = children[name]
            process.stdin.write(step + "\n")
            process.stdin.flush()
            return json.loads(process.stdout.readline())

        for step in STEPS:  # warm-up, unrecorded
            for name in SETTINGS:
                run(name, step)
        results = {(name, step): [] for name in SETTINGS for step in STEPS}
        for round_index in range(args.repeats):
            order = list(SETTINGS) if round_index % 2 == 0 else list(reversed(SETTINGS))
            for step in STEPS:
                for name in order:
                    results[(name, step)].append(run(name, step))
    finally:
        for process in children.values():
            process.stdin.close()
            process.wait(timeout=120)
    print("| step | retained ms | defaults ms | retained / defaults, per round | minor faults per step, "
          "retained / defaults |")
    print("|---|---:|---:|---:|---:|")
    labels = {"decode": f"decode, {args.batch} sequences", "prefill": f"prefill, {args.chunk} tokens",
              "mixed": "mixed: both in one forward"}
    for step in STEPS:
        kept, plain = results[("retained", step)], results[("defaults", step)]
        ratios = [a["ms"] / b["ms"] for a, b in zip(kept, plain)]
        print(f"| {labels[step]} | {spread([m['ms'] for m in kept])} | {spread([m['ms'] for m in plain])} | "
              f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}..{max(ratios):.2f}) | "
              f"{statistics.median(m['faults'] for m in kept):.0f} / "
              f"{statistics.median(m['faults'] for m in plain):.0f} |")
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
