"""The prefix cache in process: cache on vs off, interleaved, on two workloads, and what lookups cost when nothing hits.

- shared prefix: N prefixes of 1-4K tokens; requests arrive one at a time, each a prefix + a short random suffix
  (the first of each prefix is cold); TTFT = submission to first token. Hit rate = cached / prompt tokens, beside
  the achievable one (each request's tokens shared with an earlier one / prompt tokens).
- multi-turn chat replay: conversations whose every turn resends the history (earlier prompts and answers) plus
  a new message.
- no hits: unique prompts; the time spent in the cache's code (lookups, publishing, KDA checkpoints) per decode
  step, against the decode step time.

Each repetition uses fresh random prompts (both variants the same), so a repetition never hits what an earlier
one cached. Greedy outputs of the two variants are checked equal.

    .venv/bin/python -m benchmarks.bench_prefix_cache --model models/pdserve-k3-tiny --repeats 5
"""
from __future__ import annotations

import argparse
import logging
import random
import statistics
import time
from collections.abc import Callable
from functools import wraps

from benchmarks.common import (Metrics, add_common_arguments, interleave, load_note, median, paired, print_header,
                               spread)
from engine import SamplingParams
from engine.engine_config import EngineConfig
from engine.runtime.llm_engine import LLMEngine
from engine.cache.prefix_reuse import PrefixReuse
from engine.runtime.scheduler import Scheduler

VOCAB_LOW, VOCAB_HIGH = 4, 3000
logger = logging.getLogger("bench_prefix_cache")


def _tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(count)]


def _serve_one(engine: LLMEngine, rid: str, prompt: list[int], params: SamplingParams) -> tuple[float, list[int], int]:
    """One request alone: (TTFT s, generated tokens, cached prompt tokens)."""
    start = time.perf_counter()
    engine.add_request(rid, prompt, params)
    ttft, tokens, cached = None, [], 0
    while engine.has_work():
        for out in engine.step():
            if out.new_token_ids and ttft is None:
                ttft = time.perf_counter() - start
            tokens += out.new_token_ids
            cached = out.num_cached_tokens
    return ttft, tokens, cached


def _shared_len(prompt: list[int], earlier: list[list[int]]) -> int:
    best = 0
    for other in earlier:
        n = 0
        for a, b in zip(prompt, other):
            if a != b:
                break
            n += 1
        best = max(best, n)
    return best


def shared_prefix_run(engine: LLMEngine, seed: int, num_prefixes: int, per_prefix: int, lengths: tuple[int, int],
                      outputs: dict) -> Metrics:
    rng = random.Random(seed)
    prefixes = [_tokens(rng, rng.randrange(*lengths)) for _ in range(num_prefixes)]
    prompts = [prefixes[i % num_prefixes] + _tokens(rng, rng.randrange(8, 33)) for i in range(num_prefixes * per_prefix)]
    params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    ttfts, cached, shared, generated = [], 0, 0, []
    for index, prompt in enumerate(prompts):
        ttft, tokens, hit = _serve_one(engine, f"s{seed}-{index}", prompt, params)
        ttfts.append(ttft)
        generated.append(tokens)
        cached += hit
        shared += _shared_len(prompt, prompts[:index])
    total = sum(map(len, prompts))
    outputs.setdefault(seed, []).append(generated)
    return {"ttft_p50": statistics.median(ttfts), "hit_rate": cached / total, "achievable": shared / total}


def chat_run(engine: LLMEngine, seed: int, conversations: int, turns: int, outputs: dict) -> Metrics:
    rng = random.Random(seed)
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    ttfts, cached, total, generated = [], 0, 0, []
    for c in range(conversations):
        history = _tokens(rng, 400)  # a system prompt
        for t in range(turns):
            prompt = history + _tokens(rng, rng.randrange(32, 65))
            ttft, tokens, hit = _serve_one(engine, f"c{seed}-{c}-{t}", prompt, params)
            generated.append(tokens)
            if t:  # the later turns: what the cache is for
                ttfts.append(ttft)
                cached += hit
                total += len(prompt)
            history = prompt + tokens
    outputs.setdefault(seed, []).append(generated)
    return {"ttft_p50": statistics.median(ttfts), "hit_rate": cached / total}


class CacheTimer:
    """Seconds spent in the prefix cache's code (the scheduler's lookups, the engine's publishing and checkpoints)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, owner, name: str) -> Callable[[], None]:
        original = getattr(owner, name)

        @wraps(original)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        setattr(owner, name, timed)
        return lambda: setattr(owner, name, original)


def no_hit_cost(engine: LLMEngine, seed: int, requests: int) -> Metrics:
    """Unique prompts (nothing hits), 64 decode steps each; cache code time per decode step / decode step time."""
    rng = random.Random(seed)
    timer = CacheTimer()
    undo = [timer.wrap(Scheduler, "_map_cached_prefix")]
    undo += [timer.wrap(PrefixReuse, name) for name in ("restore", "after_prefill", "after_decode", "before_release")]
    decode_s, steps = 0.0, 0
    try:
        params = SamplingParams(max_new_tokens=64, temperature=0.0, ignore_eos=True, speculative=False)
        for index in range(requests):
            engine.add_request(f"u{seed}-{index}", _tokens(rng, 256), params)
        while engine.has_work():
            prefill = bool(engine.scheduler.waiting)
            start = time.perf_counter()
            engine.step()
            if not prefill:
                decode_s += time.perf_counter() - start
                steps += 1
    finally:
        for restore in undo:
            restore()
    return {"cache_ms_per_step": 1000 * timer.seconds / max(steps, 1), "step_ms": 1000 * decode_s / max(steps, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(parser, repeats=5)
    parser.add_argument("--prefixes", type=int, default=4)
    parser.add_argument("--per-prefix", type=int, default=3)
    parser.add_argument("--conversations", type=int, default=2)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--kv-memory-mb", type=int, default=256)
    args = parser.parse_args()
    lengths = (256, 1024) if args.quick else (1024, 4097)
    print_header("prefix cache: on vs off, in process", args)
    common = dict(model_dir=str(args.model), kv_memory_bytes=args.kv_memory_mb * 2**20, num_threads=args.threads)
    engines = {"off": LLMEngine(EngineConfig(prefix_cache=False, **common)),
               "on": LLMEngine(EngineConfig(prefix_cache=True, **common))}
    seeds = iter(range(args.seed * 1000, args.seed * 1000 + 10_000))
    try:
        for title, make in (
            (f"shared prefix ({args.prefixes} prefixes of {lengths[0]}-{lengths[1] - 1} tokens x {args.per_prefix} "
             "requests, suffixes 8-32, one at a time)",
             lambda engine, seed, outputs: shared_prefix_run(engine, seed, args.prefixes, args.per_prefix, lengths, outputs)),
            (f"multi-turn chat ({args.conversations} conversations x {args.turns} turns, 400-token system prompt, "
             "32-64-token messages, 24-token answers; TTFT of turns 2+)",
             lambda engine, seed, outputs: chat_run(engine, seed, args.conversations, args.turns, outputs)),
        ):
            outputs: dict = {}
            round_seeds = [next(seeds) for _ in range(args.repeats)]
            calls = {"off": 0, "on": 0}

            def variant(name: str):
                def run() -> Metrics:  # a variant's k-th run: round k's fresh prompts, the same for both variants
                    seed = round_seeds[calls[name]]
                    calls[name] += 1
                    metrics = make(engines[name], seed, outputs)
                    logger.warning("round %d %s: %s", calls[name], name, metrics)  # progress, on stderr
                    return metrics
                return run

            runs = interleave({"off": variant("off"), "on": variant("on")}, args.repeats, warmup=False)
            same = all(len(v) == 2 and v[0] == v[1] for v in outputs.values())
            ratio = paired(runs["on"], runs["off"], "ttft_p50")
            print(f"## {title}\n")
            print(f"TTFT p50 off: {spread([m['ttft_p50'] for m in runs['off']], 1000, ' ms')}; "
                  f"on: {spread([m['ttft_p50'] for m in runs['on']], 1000, ' ms')}  ")
            print(f"on / off (paired rounds): {spread(ratio, 100, '%')} (goal <= 20%)  ")
            line = f"hit rate: {spread([m['hit_rate'] for m in runs['on']], 100, '%')}"
            if "achievable" in runs["on"][0]:
                share = [m["hit_rate"] / m["achievable"] for m in runs["on"]]
                line += (f" of an achievable {spread([m['achievable'] for m in runs['on']], 100, '%')}: "
                         f"{spread(share, 100, '%')} of it (goal >= 95%)")
            print(line + "  ")
            print(f"greedy outputs on == off: {same}; load: {load_note(runs)}\n", flush=True)
        accept = {name: engine.acceptance_stats for name, engine in engines.items()}
        print("speculation over both workloads (the same prompts and outputs): "
              + "; ".join(f"{name}: {a.num_accepted_drafts}/{a.num_drafts} drafts accepted in {a.num_verify_steps} "
                          f"verify steps ({1 + a.num_accepted_drafts / max(a.num_verify_steps, 1):.2f} tokens/step)"
                          for name, a in accept.items()) + "\n")
        costs = interleave({"on": lambda: no_hit_cost(engines["on"], next(seeds), 4)}, args.repeats, warmup=True)
        share = [m["cache_ms_per_step"] / m["step_ms"] for m in costs["on"]]
        print("## no hits: the cache's code per decode step (4 unique 256-token prompts, 64 plain decode steps)\n")
        print(f"cache code: {spread([m['cache_ms_per_step'] for m in costs['on']], 1000, ' us')} per step; decode step "
              f"{median(costs['on'], 'step_ms'):.2f} ms; share {spread(share, 100, '%')} (goal <= 2%); "
              f"load: {load_note(costs)}")
    finally:
        for engine in engines.values():
            engine.close()


if __name__ == "__main__":
    main()
