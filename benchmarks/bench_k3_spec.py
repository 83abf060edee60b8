"""Speculative decoding on vs off on the K3-shaped default model (KDA + gated MLA target, DSpark draft), in
process (issue 14's benchmark, in-process half).

One LLM with the draft loaded; at each concurrency (a closed loop: the prompts in groups of that size) the
variants take turns, round r in order and round r + 1 reversed, after one unrecorded warm-up each: speculation
off, then on at each verify block. Greedy, eos ignored, the same held-out prompts. Reported per cell: the
median output tok/s (wall time of the whole generate, prefill included) with the spread (min..max) of the
repetitions, the speed-up (ratio of medians), the acceptance length (tokens per verify step, bonus
included, from the engine's counters) and whether every output equals the speculation-off output. The CPU
speed-up is the ratio of medians of tok/s over the engine thread's CPU time (at 1 thread: all of its work), the
steadier figure when the machine is shared.
The load average is printed before and after: the machine is shared.
Goal: >= 1.5x single stream (the seed measured 2.2x on MI355X).

Run: OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.bench_k3_spec [--model DIR] [--repeats 5] [--quick]
"""
from __future__ import annotations

import argparse
import os

from benchmarks.bench_spec import spec_variant
from benchmarks.common import (REPO_ROOT, ForwardTimer, Table, goal_line, interleave, make_prompts, median,
                               print_header, ratio, spread)
from engine import LLM, SamplingParams

K3_DEFAULT = REPO_ROOT / "models" / "pdserve-k3-tiny"
GOAL = 1.5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=str, default=str(K3_DEFAULT))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="2 repeats, 32 new tokens (smoke check)")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--blocks", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--min-prompts", type=int, default=4, help="a concurrency below this runs this many prompts")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.new_tokens = 2, 32
    print_header("bench_k3_spec: speculative decoding on vs off, K3-shaped default model (in process)", args)
    llm = LLM(args.model, device="cpu", num_threads=args.threads, max_running=max(args.concurrency),
              spec_block_size=max(args.blocks))
    if not llm.engine.has_draft:
        raise SystemExit(f"{args.model} has no draft/ folder")
    config = llm.model_config
    print(f"target {config.model_type}, draft {type(llm.engine.runner.draft).__name__} (gamma "
          f"{llm.engine.draft_config.block_size}); verify blocks {args.blocks}\n", flush=True)
    prompts, source = make_prompts(args.model, max(args.concurrency + [args.min_prompts]), args.prompt_len,
                                   args.seed, config.vocab_size, list(config.eos_token_id))
    columns = ["concurrency", "prompts", "off tok/s (spread)"]
    for block in args.blocks:
        columns += [f"B={block} tok/s (spread)", f"B={block} speed-up", f"B={block} CPU speed-up", f"B={block} accept len"]
    table = Table(f"K3 speculative decoding, greedy, prompt {args.prompt_len} + {args.new_tokens} new tokens "
                  f"({source}), median of {args.repeats} interleaved repetitions", columns + ["identical"])
    single: dict[int, float] = {}
    timers = (ForwardTimer(llm.engine.runner, "forward_target"), ForwardTimer(llm.engine.runner, "forward_draft"))
    for concurrency in args.concurrency:
        group = prompts[: max(concurrency, args.min_prompts)]
        outputs: dict[str, list] = {}
        variants = {"off": spec_variant(llm, group, concurrency, SamplingParams(
            max_new_tokens=args.new_tokens, temperature=0.0, ignore_eos=True, speculative=False), outputs, "off", timers)}
        for block in args.blocks:
            params = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0, ignore_eos=True,
                                    speculative=True, block_size=block)
            variants[f"B={block}"] = spec_variant(llm, group, concurrency, params, outputs, f"B={block}", timers)
        runs = interleave(variants, args.repeats)
        off, off_cpu = median(runs["off"], "tok_s"), median(runs["off"], "cpu_tok_s")
        cells: list[object] = [concurrency, len(group), spread([r["tok_s"] for r in runs["off"]])]
        for block in args.blocks:
            on, on_cpu = median(runs[f"B={block}"], "tok_s"), median(runs[f"B={block}"], "cpu_tok_s")
            cells += [spread([r["tok_s"] for r in runs[f"B={block}"]]), f"{ratio(on, off):.2f}x",
                      f"{ratio(on_cpu, off_cpu):.2f}x", median(runs[f"B={block}"], "accept_len")]
            if concurrency == 1:
                single[block] = ratio(on, off)
        same = sum(all(outputs[f"B={b}"][i] == outputs["off"][i] for b in args.blocks) for i in range(len(group)))
        table.add(*cells, f"{same}/{len(group)}")
        print(f"concurrency {concurrency} done", flush=True)
    print()
    table.print()
    print(f"load average at the end: {os.getloadavg()[0]:.1f} (1 min), {os.getloadavg()[1]:.1f} (5 min)\n")
    if single:
        best = max(single, key=single.get)
        print("## Goals\n")
        print(f"- {goal_line(f'single-stream speed-up in process (best block B={best})', single[best], GOAL)}")
    llm.close()


if __name__ == "__main__":
    main()
