"""Before / after for benchmarks/profile_first_token.py: runs it in two source trees by turns (each a fresh
process, --runs times each, alternating which goes first) and prints each piece's median over every round
of every run, with the spread (p10..p90) and the load average seen. CPU figures, so a shared machine
inflates both sides alike; interleaving keeps drift from favouring either.

The "before" tree needs the harness too: copy benchmarks/profile_first_token.py and
benchmarks/first_token_*.py into it (e.g. a `git archive <commit>` export).

Run: .venv/bin/python -m benchmarks.first_token_ab --before DIR --after DIR [--runs 6] [--reps 150] [--rounds 3]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path


def run_once(tree: Path, reps: int, rounds: int) -> dict:
    """One harness process in `tree` (its code first on the path), 1 torch / BLAS thread."""
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "benchmarks.profile_first_token", "--json", "--reps", str(reps),
               "--rounds", str(rounds)]
    output = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(output.strip().splitlines()[-1])


def spread(values: list[float]) -> str:
    ordered = sorted(values)
    low, high = ordered[len(ordered) // 10], ordered[(len(ordered) * 9) // 10 - (len(ordered) % 10 == 0)]
    return f"{low:.1f}..{high:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, required=True)
    parser.add_argument("--after", type=Path, required=True)
    parser.add_argument("--runs", type=int, default=6)
    parser.add_argument("--reps", type=int, default=150)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    values: dict[str, dict[str, list[float]]] = {name: {} for name in trees}
    loads: list[float] = []
    for run in range(args.runs):
        for name in (("before", "after") if run % 2 == 0 else ("after", "before")):
            result = run_once(trees[name], args.reps, args.rounds)
            loads.extend(result["load"])
            for piece, rounds in result["pieces"].items():
                values[name].setdefault(piece, []).extend(rounds)
    print(f"{args.runs} runs x {args.rounds} rounds x {args.reps} calls per tree, taking turns; "
          f"load average {min(loads):.2f}..{max(loads):.2f}")
    print(f"{'piece (CPU us per call)':<58} {'before':>8} {'p10..p90':>14} {'after':>8} {'p10..p90':>14}")
    for piece in values["after"]:
        before, after = values["before"].get(piece), values["after"][piece]
        old = f"{statistics.median(before):>8.1f} {spread(before):>14}" if before else f"{'-':>8} {'':>14}"
        print(f"{piece:<58} {old} {statistics.median(after):>8.1f} {spread(after):>14}")


if __name__ == "__main__":
    main()
