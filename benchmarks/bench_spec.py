"""Speculative decoding on vs off, in process, on one LLM with the draft loaded (issues 3 and 4; issue 7 (b)).

For every batch size the variants take turns: speculation off, then on with each block size (greedy, ignore
eos, same prompts). Reported: output tok/s (wall time of the whole generate, prefill included), the speed-up
over "off" at the same batch size, and the acceptance length (mean tokens emitted per verify step, bonus
token included) read from the engine's acceptance counters. Greedy speculation must not change the output;
the "identical" column checks it. "CPU speed-up" is the same ratio over the engine thread's CPU time (the
whole generate; with --threads 1 that is all of the engine's work), which a shared machine disturbs far less.
A second table splits one decode step of every variant into the target forward (decode or verify), the draft
forward and the rest (planning, sampling, verification, bookkeeping), and gives its cost over a plain step.
The prompts are the held-out set of benchmarks/prompts.py (16 by default, 8 kinds of text, shared with
bench_k3_spec and bench_gateway); single stream (batch 1) a per-prompt table gives each prompt's speed-up
(CPU, per round of the interleaved repetitions) and acceptance length, with the load averages the runs saw.
Goals: issue 4, single-stream speed-up >= 2.0x on the trained default model; issue 18, >= 1.8x on held-out
prompts and a spec step <= 1.3x a plain step.

--dtype / --draft-dtype set the engine's (default auto: float32 on CPU, the draft in the target's dtype);
--compare-draft-dtype D adds a second engine whose draft runs in D, its largest block taking turns
with the others as "B=b draft D" (same target, so the same outputs).

Run: .venv/bin/python -m benchmarks.bench_spec [--model DIR] [--quick]
(issue 18 single stream: --threads 1 --batches 1 --blocks 4 8 --repeats 5)
"""
from __future__ import annotations

import argparse
import statistics

from benchmarks.common import (ForwardTimer, Table, add_common_arguments, goal_line, interleave, load_note, median,
                               print_header, ratio, spread)
from benchmarks.prompts import DEFAULT_COUNT, held_out_prompts
from benchmarks.spec_runs import per_prompt_table, spec_variant, spec_variants
from engine import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_arguments(parser, repeats=3)
    parser.add_argument("--draft", default=None, help="draft directory (default: the model's draft/ folder)")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8, 16, 64])
    parser.add_argument("--min-prompts", type=int, default=DEFAULT_COUNT,
                        help="small batches run this many prompts (the held-out set of benchmarks/prompts.py), in "
                             "consecutive groups of the batch size")
    parser.add_argument("--blocks", type=int, nargs="+", default=[4, 8, 16],
                        help="block sizes (those above the draft's own block size are skipped)")
    parser.add_argument("--backoff", type=float, nargs="*", default=[],
                        help="also run the largest block with the engine's speculation back-off at these tokens per "
                             "verify step (spec_min_tokens_per_step; none: skip)")
    parser.add_argument("--dtype", default="auto", help="the engine's dtype (auto: float32 on CPU)")
    parser.add_argument("--draft-dtype", default="auto", help="the draft's dtype (auto: the target's)")
    parser.add_argument("--compare-draft-dtype", default=None,
                        help="also run the largest block on a second engine whose draft runs in this dtype")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.new_tokens = 1, min(args.new_tokens, 64)
        args.batches = [b for b in args.batches if b <= 16]
    print_header("bench_spec: speculative decoding on vs off (in process)", args)
    probe = LLM(str(args.model), draft_model=args.draft, num_threads=args.threads, kv_memory_bytes=16 * 2**20)
    if not probe.engine.has_draft:
        raise SystemExit(f"{args.model} has no draft model (pass --draft DIR)")
    draft_block = probe.engine.draft_config.block_size
    probe.close()
    blocks = [b for b in args.blocks if 2 <= b <= draft_block]
    skipped = [b for b in args.blocks if b not in blocks]
    engine_args = dict(draft_model=args.draft, num_threads=args.threads, max_running=max(args.batches),
                       spec_block_size=max(blocks), dtype=args.dtype)
    llm = LLM(str(args.model), draft_dtype=args.draft_dtype, **engine_args)
    other = (LLM(str(args.model), draft_dtype=args.compare_draft_dtype, **engine_args)
             if args.compare_draft_dtype else None)
    print(f"dtype {llm.engine.config.torch_dtype_name}, draft dtype {llm.engine.config.draft_dtype_name}"
          + (f"; compared with a {other.engine.config.draft_dtype_name} draft" if other else ""))
    config = llm.model_config
    bench_prompts, source = held_out_prompts(args.model, max(args.batches + [args.min_prompts]), args.prompt_len,
                                             config.vocab_size, list(config.eos_token_id), args.seed)
    prompts = [p.token_ids for p in bench_prompts]
    print(f"draft block size {draft_block}; block sizes measured: {blocks}"
          + (f" (skipped {skipped}: larger than the draft's block)" if skipped else "") + "\n", flush=True)
    names = [f"B={block}" for block in blocks] + [f"B={max(blocks)} back-off {t:g}" for t in args.backoff]
    other_name = f"B={max(blocks)} draft {args.compare_draft_dtype}"
    names += [other_name] if other else []
    table = Table(f"speculative decoding, greedy, prompt {args.prompt_len} + {args.new_tokens} new tokens ({source})",
                  ["batch", "prompts", "off tok/s (spread)"]
                  + [c for n in names for c in (f"{n} tok/s (spread)", f"{n} speed-up", f"{n} CPU speed-up",
                                                 f"{n} accept len")]
                  + ["identical", "load"])
    split = Table("one decode step, split (ms; step = mean decode-step wall time, forwards = medians of the run's "
                  "target / draft forward calls, rest = step - target - draft: planning, sampling, verification, "
                  "bookkeeping)", ["batch", "variant", "step ms", "target forward ms", "draft forward ms", "rest ms",
                                   "step / plain step"])
    timers = (ForwardTimer(llm.engine.runner, "forward_target"), ForwardTimer(llm.engine.runner, "forward_draft"))
    other_timers = ((ForwardTimer(other.engine.runner, "forward_target"), ForwardTimer(other.engine.runner, "forward_draft"))
                    if other else timers)
    single: dict[str, float] = {}
    single_cpu: dict[str, float] = {}
    per_prompt = []
    for batch in args.batches:
        outputs: dict[str, list] = {}
        batch_prompts = prompts[: batch * max(1, args.min_prompts // batch)]
        variants = spec_variants(llm, batch_prompts, batch, args.new_tokens, blocks, args.backoff, outputs, timers)
        if other is not None:
            params = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0, ignore_eos=True,
                                    block_size=max(blocks))
            variants[other_name] = spec_variant(other, batch_prompts, batch, params, outputs, other_name, other_timers)
        runs = interleave(variants, args.repeats)
        off, off_cpu = median(runs["off"], "tok_s"), median(runs["off"], "cpu_tok_s")
        cells: list[object] = [batch, spread([r["tok_s"] for r in runs["off"]])]
        for name in names:
            on, on_cpu = median(runs[name], "tok_s"), median(runs[name], "cpu_tok_s")
            cells += [spread([r["tok_s"] for r in runs[name]]), f"{ratio(on, off):.2f}x",
                      f"{ratio(on_cpu, off_cpu):.2f}x", median(runs[name], "accept_len")]
            if batch == 1:
                single[name] = ratio(on, off)
                single_cpu[name] = ratio(on_cpu, off_cpu)
        plain_step = median(runs["off"], "step_ms")
        for name, samples in runs.items():
            step, target, draft = (median(samples, key) for key in ("step_ms", "target_ms", "draft_ms"))
            split.add(batch, name, step, target, draft, step - target - draft, f"{ratio(step, plain_step):.2f}x")
        same = sum(all(outputs[name][i] == outputs["off"][i] for name in names) for i in range(len(batch_prompts)))
        cells += [f"{same}/{len(batch_prompts)}", load_note(runs)]
        table.add(batch, len(batch_prompts), *cells[1:])
        if batch == 1:
            for name in names:
                per_prompt.append(per_prompt_table(
                    f"single stream, {name}, per prompt: median of {args.repeats} interleaved rounds (CPU speed-up: "
                    "per round, on / off CPU tok/s, median (min..max))", bench_prompts[: len(batch_prompts)],
                    runs["off"], runs[name]))
        print(f"batch {batch} done", flush=True)
    print()
    table.print()
    for prompt_table, speedups in per_prompt:
        prompt_table.print()
        print(f"per-prompt CPU speed-up: median {statistics.median(speedups):.2f}x, "
              f"min {min(speedups):.2f}x, max {max(speedups):.2f}x\n")
    split.print()
    stats = llm.acceptance_stats
    rates = ", ".join(f"{rate:.2f}" for rate in stats.per_position_acceptance)
    print(f"per-position acceptance over every verify step of this run (all block sizes): {rates}\n")
    if single:
        best = max(single, key=single.get)
        print("## Goals\n")
        print(f"- {goal_line(f'single-stream speed-up (issue 4; best variant {best})', single[best], 2.0)}")
        if "B=8" in single:
            print(f"- {goal_line('single-stream speed-up at B=8', single['B=8'], 2.0)}")
        for clock, figures in (("wall", single), ("CPU", single_cpu)):
            print(f"- {goal_line(f'issue 18: single-stream {clock} speed-up on the held-out prompts ({best})', figures[best], 1.8)}")
    llm.close()
    if other is not None:
        other.close()


if __name__ == "__main__":
    main()
