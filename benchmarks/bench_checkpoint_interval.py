"""KDA state checkpoint interval (EngineConfig.state_checkpoint_interval): what a smaller interval costs and buys.

Two engines with the prefix cache on, one per interval, taking turns on the same prompts each round (fresh ones
every round): A = a prefix of 1-4K tokens + a suffix (cold: pays the chunking at checkpoint positions and the
checkpoint copies), B = the same prefix + another suffix (the first request sharing it: restores the last
checkpoint inside the prefix and recomputes up to interval - 16 tokens to the branch point), C = the prefix + a
third suffix (hits the branch-point checkpoint: the interval no longer matters). Reported per interval: TTFT of A,
B and C, checkpoints saved for A and the time its checkpoint copies took, the bytes of one checkpoint and so the
checkpoint memory one prompt pins.

    .venv/bin/python -m benchmarks.bench_checkpoint_interval --model models/pdserve-k3-tiny --repeats 5
"""
from __future__ import annotations

import argparse
import random
import time

from benchmarks.bench_prefix_cache import _serve_one, _tokens
from benchmarks.common import Metrics, add_common_arguments, interleave, load_note, paired, print_header, spread
from engine import SamplingParams
from engine.engine_config import EngineConfig
from engine.runtime.llm_engine import LLMEngine
from engine.runtime.step_plan import CheckpointStatePlan


class SaveTimer:
    """Seconds the engine spent copying states into checkpoints (CheckpointStatePlan with save=True)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.seconds, self.count = 0.0, 0
        execute = engine._reuse.execute

        def timed(plan):
            if not (isinstance(plan, CheckpointStatePlan) and plan.save):
                return execute(plan)
            start = time.perf_counter()
            try:
                return execute(plan)
            finally:
                self.seconds += time.perf_counter() - start
                self.count += len(plan.pairs)

        engine._reuse.execute = timed


def one_round(engine: LLMEngine, timer: SaveTimer, seed: int) -> Metrics:
    rng = random.Random(seed)
    prefix = _tokens(rng, rng.randrange(1024, 4097))
    params = SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True, speculative=False)
    metrics: Metrics = {"prefix": len(prefix)}
    for name in ("a", "b", "c"):
        saved_s, saved = timer.seconds, timer.count
        ttft, _, cached = _serve_one(engine, f"{name}{seed}", prefix + _tokens(rng, rng.randrange(16, 33)), params)
        metrics |= {f"ttft_{name}": ttft, f"cached_{name}": cached, f"saves_{name}": timer.count - saved,
                    f"save_s_{name}": timer.seconds - saved_s}
    return metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(parser, repeats=5)
    parser.add_argument("--intervals", default="64,128")
    parser.add_argument("--kv-memory-mb", type=int, default=256)
    args = parser.parse_args()
    print_header("KDA checkpoint interval: cost and benefit", args)
    intervals = [int(text) for text in args.intervals.split(",")]
    engines = {str(interval): LLMEngine(EngineConfig(model_dir=str(args.model), num_threads=args.threads,
                                                     kv_memory_bytes=args.kv_memory_mb * 2**20,
                                                     state_checkpoint_interval=interval))
               for interval in intervals}
    timers = {name: SaveTimer(engine) for name, engine in engines.items()}
    seeds = [args.seed * 1000 + r for r in range(args.repeats)]
    calls = {name: 0 for name in engines}

    def variant(name: str):
        def run() -> Metrics:
            seed = seeds[calls[name]]
            calls[name] += 1
            return one_round(engines[name], timers[name], seed)
        return run

    try:
        runs = interleave({name: variant(name) for name in engines}, args.repeats, warmup=False)
        for name, engine in engines.items():
            per_checkpoint = engine.runner.checkpoints[0].numel() * engine.runner.checkpoints.element_size()
            samples = runs[name]
            print(f"## interval {name}\n")
            print(f"one checkpoint: {per_checkpoint / 2**20:.2f} MiB (this model, one rank); pool: "
                  f"{engine.prefix_cache_stats.checkpoint_slots} slots  ")
            for key, label in (("a", "A (cold)"), ("b", "B (first sharer: to the branch point)"), ("c", "C (later)")):
                print(f"{label}: TTFT {spread([m[f'ttft_{key}'] for m in samples], 1000, ' ms')}, cached "
                      f"{spread([m[f'cached_{key}'] for m in samples])} tokens of prefixes "
                      f"{spread([m['prefix'] for m in samples])}, checkpoints saved "
                      f"{spread([m[f'saves_{key}'] for m in samples])} in "
                      f"{spread([m[f'save_s_{key}'] for m in samples], 1000, ' ms')}  ")
            pinned = [m["saves_a"] * per_checkpoint / 2**20 for m in samples]
            print(f"checkpoint memory one cold prompt leaves: {spread(pinned, 1, ' MiB')}\n")
        if len(intervals) == 2:
            small, large = (str(interval) for interval in intervals)
            for key in ("a", "b", "c"):
                ratio = paired(runs[small], runs[large], f"ttft_{key}")
                print(f"TTFT {key.upper()}: interval {small} / {large} (paired rounds): {spread(ratio, 100, '%')}  ")
        print(f"\nload: {load_note(runs)}")
    finally:
        for engine in engines.values():
            engine.close()


if __name__ == "__main__":
    main()
