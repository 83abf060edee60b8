"""Speculative decoding on vs off on the K3-shaped default model (KDA + gated MLA target, DSpark draft), in
process (issue 14's benchmark, in-process half).

One LLM with the draft loaded; at each concurrency (a closed loop: the prompts in groups of that size) the
variants take turns, round r in order and round r + 1 reversed, after one unrecorded warm-up each: speculation
off, then on at each verify block. Greedy, eos ignored, the held-out prompt set of benchmarks/prompts.py (16
prompts of 8 kinds by default, shared with bench_spec and bench_gateway). Reported per cell: the median output
tok/s (wall time of the whole generate, prefill included) with the spread (min..max) of the repetitions, the
speed-up (ratio of medians), the acceptance length (tokens per verify step, bonus included, from the engine's
counters) and whether every output equals the speculation-off output. The CPU speed-up is the ratio of medians
of tok/s over the engine thread's CPU time (at 1 thread: all of its work), the steadier figure when the machine
is shared. Single stream, a per-prompt table gives each prompt's speed-up and acceptance length.
The load average is printed before and after: the machine is shared.
Goals: >= 1.5x single stream (issue 14; the seed measured 2.2x on MI355X), >= 1.8x (issue 18).

Run: OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.bench_k3_spec [--model DIR] [--repeats 5] [--quick]
"""
from __future__ import annotations

import argparse
import os
import statistics

from benchmarks.common import (REPO_ROOT, ForwardTimer, Table, goal_line, interleave, load_note, median, print_header,
                               ratio, spread)
from benchmarks.prompts import DEFAULT_COUNT, held_out_prompts
from benchmarks.spec_runs import per_prompt_table, spec_variants
from engine import LLM
from engine.kernels import cpu_native

K3_DEFAULT = REPO_ROOT / "models" / "pdserve-k3-tiny"
GOAL = 1.5


def without_native(run):
    """The variant with engine/kernels/cpu_native.py's C loops off (PyTorch ops) while it runs."""
    def wrapped():
        cpu_native.ENABLED = False
        try:
            return run()
        finally:
            cpu_native.ENABLED = True
    return wrapped


def native_row(concurrency: int, runs: dict, spec: str) -> list[object]:
    off, off_torch = median(runs["off"], "tok_s"), median(runs["off (torch ops)"], "tok_s")
    on, on_torch = median(runs[spec], "tok_s"), median(runs[f"{spec} (torch ops)"], "tok_s")
    return [concurrency, f"{off:.1f}", f"{off_torch:.1f}", f"{ratio(off, off_torch):.2f}x", f"{on:.1f}",
            f"{on_torch:.1f}", f"{ratio(on, on_torch):.2f}x", f"{ratio(on_torch, off_torch):.2f}x"]


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
    parser.add_argument("--min-prompts", type=int, default=DEFAULT_COUNT,
                        help="a concurrency below this runs this many prompts (the held-out set of benchmarks/prompts.py)")
    parser.add_argument("--torch-ops", action="store_true",
                        help="also run speculation off and the largest block with the C loops of "
                             "engine/kernels/cpu_native.py off (PyTorch ops), taking turns with the rest")
    parser.add_argument("--backoff", type=float, nargs="*", default=[],
                        help="also run the largest block with the engine's speculation back-off at these tokens per "
                             "verify step (spec_min_tokens_per_step; none: skip)")
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
    bench_prompts, source = held_out_prompts(args.model, max(args.concurrency + [args.min_prompts]), args.prompt_len,
                                             config.vocab_size, list(config.eos_token_id), args.seed)
    prompts = [p.token_ids for p in bench_prompts]
    names = [f"B={block}" for block in args.blocks] + [f"B={max(args.blocks)} back-off {t:g}" for t in args.backoff]
    columns = ["concurrency", "prompts", "off tok/s (spread)"]
    for name in names:
        columns += [f"{name} tok/s (spread)", f"{name} speed-up", f"{name} CPU speed-up", f"{name} accept len"]
    table = Table(f"K3 speculative decoding, greedy, prompt {args.prompt_len} + {args.new_tokens} new tokens "
                  f"({source}), median of {args.repeats} interleaved repetitions", columns + ["identical", "load"])
    single: dict[str, float] = {}
    single_cpu: dict[str, float] = {}
    per_prompt = []
    native_rows: list[list[object]] = []
    timers = (ForwardTimer(llm.engine.runner, "forward_target"), ForwardTimer(llm.engine.runner, "forward_draft"))
    for concurrency in args.concurrency:
        group = prompts[: max(concurrency, args.min_prompts)]
        outputs: dict[str, list] = {}
        variants = spec_variants(llm, group, concurrency, args.new_tokens, args.blocks, args.backoff, outputs, timers)
        if args.torch_ops:
            variants.update({f"{name} (torch ops)": without_native(variants[name]) for name in ("off", f"B={max(args.blocks)}")})
        runs = interleave(variants, args.repeats)
        if args.torch_ops:
            native_rows.append(native_row(concurrency, runs, f"B={max(args.blocks)}"))
        off, off_cpu = median(runs["off"], "tok_s"), median(runs["off"], "cpu_tok_s")
        cells: list[object] = [concurrency, len(group), spread([r["tok_s"] for r in runs["off"]])]
        for name in names:
            on, on_cpu = median(runs[name], "tok_s"), median(runs[name], "cpu_tok_s")
            cells += [spread([r["tok_s"] for r in runs[name]]), f"{ratio(on, off):.2f}x",
                      f"{ratio(on_cpu, off_cpu):.2f}x", median(runs[name], "accept_len")]
            if concurrency == 1:
                single[name] = ratio(on, off)
                single_cpu[name] = ratio(on_cpu, off_cpu)
                per_prompt.append(per_prompt_table(
                    f"single stream, {name}, per prompt: median of {args.repeats} interleaved rounds (CPU speed-up: "
                    "per round, on / off CPU tok/s, median (min..max))", bench_prompts[: len(group)], runs["off"],
                    runs[name]))
        compared = [name for name in outputs if name != "off"]  # every variant, the torch-ops ones too
        same = sum(all(outputs[name][i] == outputs["off"][i] for name in compared) for i in range(len(group)))
        table.add(*cells, f"{same}/{len(group)}", load_note(runs))
        print(f"concurrency {concurrency} done", flush=True)
    print()
    table.print()
    if native_rows:
        native = Table("C loops (engine/kernels/cpu_native.py) vs PyTorch ops, same runs: median tok/s",
                       ["concurrency", "off, C", "off, torch", "off C / torch", "spec, C", "spec, torch",
                        "spec C / torch", "speed-up with torch ops"])
        for row in native_rows:
            native.add(*row)
        native.print()
    for prompt_table, speedups in per_prompt:
        prompt_table.print()
        print(f"per-prompt CPU speed-up: median {statistics.median(speedups):.2f}x, "
              f"min {min(speedups):.2f}x, max {max(speedups):.2f}x\n")
    print(f"load average at the end: {os.getloadavg()[0]:.1f} (1 min), {os.getloadavg()[1]:.1f} (5 min)\n")
    if single:
        best = max(single, key=single.get)
        print("## Goals\n")
        print(f"- {goal_line(f'single-stream speed-up in process (best variant {best})', single[best], GOAL)}")
        for clock, figures in (("wall", single), ("CPU", single_cpu)):
            print(f"- {goal_line(f'issue 18: single-stream {clock} speed-up on the held-out prompts ({best})', figures[best], 1.8)}")
    llm.close()


if __name__ == "__main__":
    main()
