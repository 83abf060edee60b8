"""CPU of our own Python on the first-token path, piece by piece, in one process without gRPC (issue 18 item 3).

The gateway side runs the real Generate handler (wrapped by the interceptors every server installs) over a
real WorkerPool whose stubs answer at once (they serialise the request and parse the reply, as gRPC's
Python layer does); the prefill side runs the real Prefill handler over a real PrefillService, a real shm
pool reserved as a decode worker does, and the pdserve-tiny engine with its forward replaced by an instant
answer. So what is measured is everything but gRPC's own transport and the model forward.

Pieces are timed with thread_time_ns (CPU of the calling thread; 'handler' rows with process_time_ns: the
prefill handler includes its engine thread), each the mean of --reps calls, median (min..max) of --rounds
interleaved rounds; the clock's own cost is subtracted. CPU, not wall: the machine may be shared.

Run: .venv/bin/python -m benchmarks.profile_first_token [--reps 400] [--rounds 7] [--prompt-tokens 128] [--json]
(benchmarks/first_token_ab.py runs it in two source trees by turns: before / after a change.)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

from benchmarks.common import DEFAULT_MODEL
from benchmarks.first_token_fixtures import Piece, interceptor_pieces
from benchmarks.first_token_gateway import GatewaySide
from benchmarks.first_token_prefill import PrefillSide
from rpc.server import run


def clock_cost_ns(clock: Callable[[], int], calls: int = 2000) -> int:
    """What one clock() pair adds to a measurement (subtracted from every piece)."""
    start = clock()
    for _ in range(calls):
        clock()
    return (clock() - start) // calls


async def measure(pieces: dict[str, Piece], reps: int, rounds: int) -> dict[str, list[float]]:
    """Mean CPU us per call of each piece, one value per round; pieces take turns within each round."""
    overhead = {time.thread_time_ns: clock_cost_ns(time.thread_time_ns),
                time.process_time_ns: clock_cost_ns(time.process_time_ns)}
    floor = min(overhead.values())
    results: dict[str, list[float]] = {name: [] for name in pieces}
    for _ in range(rounds):
        for name, piece in pieces.items():
            total = 0
            for _ in range(reps):
                total += await piece()
            results[name].append(max(0.0, total / reps - floor) / 1000)
    return results


def report(results: dict[str, list[float]]) -> None:
    print(f"{'piece':<58} {'median us':>10} {'min..max':>16}")
    for name, values in results.items():
        print(f"{name:<58} {statistics.median(values):>10.1f} {min(values):>7.1f}..{max(values):<8.1f}")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--reps", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--json", action="store_true", help="print {piece: [us per round]} as JSON only")
    args = parser.parse_args()
    prompt = [(7 * i + 3) % 1000 + 10 for i in range(args.prompt_tokens)]
    prefill = await PrefillSide.start(args.model)
    gateway = await GatewaySide.start(args.model, prefill.layout)
    try:
        pieces: dict[str, Piece] = {}
        pieces.update(gateway.pieces(prompt))
        pieces.update(prefill.pieces(prompt))
        pieces.update(interceptor_pieces())
        load = os.getloadavg()[0]
        results = await measure(pieces, args.reps, args.rounds)
        if args.json:
            print(json.dumps({"load": [load, os.getloadavg()[0]], "pieces": results}))
            return
        print(f"load average before: {load:.2f}")
        print(f"load average after: {os.getloadavg()}; {args.rounds} rounds x {args.reps} calls, "
              f"{args.prompt_tokens}-token prompts")
        report(results)
    finally:
        await gateway.close()
        await prefill.close()


if __name__ == "__main__":
    run(main)  # uvloop and the GIL switch interval every pdserve process runs with
