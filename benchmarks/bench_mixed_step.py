"""One mixed step against the two steps it replaces, in process: a decode step of --batch sequences (context
--context tokens each), a --chunk-token prefill step, and the MIXED forward carrying both (ForwardMode.MIXED,
engine/runtime/scheduler.py), each timed alone, taking turns over --repeats rounds. Reported: each step's median
(min..max) in ms and the per-round ratio mixed / (decode + prefill): what a decode worker saves when a local
prefill chunk joins its decode step instead of running as a step of its own.

Model: peer_vllm's DeepSeek-V3-geometry checkpoint (written once under ~/.cache/pdserve-peer), or --model.

Run: .venv/bin/python -m benchmarks.bench_mixed_step [--repeats 7] [--threads 2] [--batch 16] [--chunk 128]
"""
from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

from benchmarks.common import add_common_arguments, interleave, load_note, paired, print_header, spread
from benchmarks.peer_servers import CACHE_DIR, write_peer_checkpoint


def step_arguments(doc: str, repeats: int) -> argparse.ArgumentParser:
    """The common benchmark flags (model default: peer_vllm's checkpoint) and the step shapes of step_plans."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    add_common_arguments(parser, repeats=repeats)
    parser.set_defaults(model=None)
    parser.add_argument("--batch", type=int, default=16, help="decoding sequences")
    parser.add_argument("--context", type=int, default=150, help="each decoding sequence's cached tokens")
    parser.add_argument("--chunk", type=int, default=128, help="prefill chunk tokens")
    return parser


def step_plans(engine, args: argparse.Namespace) -> dict[str, object]:
    """{decode, prefill, mixed}: --batch decoding sequences of --context cached tokens, a fresh --chunk-token
    prompt, and both in one MIXED step (random token ids from --seed; pages taken from the engine's pool)."""
    from engine.runtime.step_plan import DecodeItem, PrefillItem, decode_plan, mixed_plan, prefill_plan

    rng = random.Random(args.seed)
    decoding = [DecodeItem([rng.randrange(100, 1000)], args.context, engine.allocate_pages(args.context + 1))
                for _ in range(args.batch)]
    chunk = [PrefillItem([rng.randrange(100, 1000) for _ in range(args.chunk)], 0, args.chunk,
                         engine.allocate_pages(args.chunk), True)]
    return {"decode": decode_plan(decoding), "prefill": prefill_plan(chunk), "mixed": mixed_plan(decoding, chunk)}


def main() -> None:
    args = step_arguments(__doc__, repeats=7).parse_args()
    if args.quick:
        args.repeats = 2
    if args.model is None:
        args.model = CACHE_DIR / "dsv3-peer-83m"
        write_peer_checkpoint(Path(args.model), args.seed)
    print_header("A mixed step vs the decode and prefill steps it replaces (in process)", args)

    from engine import LLM

    with LLM(str(args.model), draft_model="", page_size=16, max_running=max(32, args.batch), prefix_cache=False,
             num_threads=args.threads) as llm:
        engine = llm.engine
        plans = step_plans(engine, args)

        def timed(plan):
            def run() -> dict[str, float]:
                started = time.perf_counter()
                engine.leader.execute(plan)
                return {"ms": (time.perf_counter() - started) * 1000}
            return run

        runs = interleave({name: timed(plan) for name, plan in plans.items()}, args.repeats)
    print(f"| step | ms, median (min..max) of {args.repeats} |")
    print("|---|---:|")
    for name, label in (("decode", f"decode, {args.batch} sequences"), ("prefill", f"prefill, {args.chunk} tokens"),
                        ("mixed", "mixed: both in one forward")):
        print(f"| {label} | {spread([m['ms'] for m in runs[name]])} |")
    separate = [d["ms"] + p["ms"] for d, p in zip(runs["decode"], runs["prefill"])]
    ratios = paired(runs["mixed"], [{"ms": value} for value in separate], "ms")
    print(f"\nmixed / (decode + prefill), per round: {statistics.median(ratios):.2f}x ({min(ratios):.2f}.."
          f"{max(ratios):.2f}); load {load_note(runs)}")


if __name__ == "__main__":
    main()
