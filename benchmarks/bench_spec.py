"""Speculative decoding on vs off, in process, on one LLM with the draft loaded (issues 3 and 4; issue 7 (b)).

For every batch size the variants take turns: speculation off, then on with each block size (greedy, ignore
eos, same prompts). Reported: output tok/s (wall time of the whole generate, prefill included), the speed-up
over "off" at the same batch size, and the acceptance length (mean tokens emitted per verify step, bonus
token included) read from the engine's acceptance counters. Greedy speculation must not change the output;
the "identical" column checks it. "CPU speed-up" is the same ratio over the engine thread's CPU time (the
whole generate; with --threads 1 that is all of the engine's work), which a shared machine disturbs far less.
A second table splits one decode step of every variant into the target forward (decode or verify), the draft
forward and the rest (planning, sampling, verification, bookkeeping), and gives its cost over a plain step.
Goal (issue 4): single-stream speed-up >= 2.0x on the trained default model; issue 18: a spec step <= 1.3x a
plain step.

Run: .venv/bin/python -m benchmarks.bench_spec [--model DIR] [--quick]
"""
from __future__ import annotations

import argparse
import statistics
import time

from benchmarks.common import (ForwardTimer, Table, add_common_arguments, goal_line, interleave, make_prompts,
                               median, print_header, ratio, timed_groups)
from engine import LLM, SamplingParams


def acceptance_counts(llm: LLM) -> tuple[int, int, list[int], list[int]]:
    stats = llm.acceptance_stats
    return stats.num_verify_steps, stats.num_accepted_drafts, list(stats.position_attempted), list(stats.position_accepted)


def spec_variant(llm: LLM, prompts: list[list[int]], batch: int, params: SamplingParams, outputs: dict, key: str,
                 timers: tuple[ForwardTimer, ForwardTimer]):
    """A run (the prompts in groups of `batch`) that also reports the acceptance length of its verify steps and
    the median wall time of its target forwards (decode or verify; prefill calls are few) and draft forwards."""

    def run():
        steps0, accepted0, _, _ = acceptance_counts(llm)
        for timer in timers:
            timer.take()
        cpu_start = time.thread_time()
        timed = timed_groups(llm.engine, prompts, params, batch)
        cpu_seconds = time.thread_time() - cpu_start
        steps, accepted, _, _ = acceptance_counts(llm)
        outputs[key] = timed.outputs
        metrics = timed.metrics()
        # At 1 torch thread the engine's work runs on this thread: CPU tok/s is steady on a shared machine.
        metrics["cpu_tok_s"] = timed.new_tokens / cpu_seconds if cpu_seconds > 0 else float("nan")
        target, draft = (timer.take() for timer in timers)
        metrics["target_ms"] = 1e3 * statistics.median(target)
        metrics["draft_ms"] = 1e3 * statistics.median(draft) if draft else 0.0
        if steps > steps0:
            metrics["accept_len"] = (accepted - accepted0 + steps - steps0) / (steps - steps0)
        return metrics

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_arguments(parser, repeats=3)
    parser.add_argument("--draft", default=None, help="draft directory (default: the model's draft/ folder)")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8, 16, 64])
    parser.add_argument("--min-prompts", type=int, default=8,
                        help="small batches run this many prompts, in consecutive groups of the batch size")
    parser.add_argument("--blocks", type=int, nargs="+", default=[4, 8, 16],
                        help="block sizes (those above the draft's own block size are skipped)")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.new_tokens = 1, min(args.new_tokens, 64)
        args.batches = [b for b in args.batches if b <= 16]
    print_header("bench_spec: speculative decoding on vs off (in process)", args)
    probe = LLM(str(args.model), draft_model=args.draft, num_threads=args.threads, kv_memory_bytes=2**20)
    if not probe.engine.has_draft:
        raise SystemExit(f"{args.model} has no draft model (pass --draft DIR)")
    draft_block = probe.engine.draft_config.block_size
    probe.close()
    blocks = [b for b in args.blocks if 2 <= b <= draft_block]
    skipped = [b for b in args.blocks if b not in blocks]
    llm = LLM(str(args.model), draft_model=args.draft, num_threads=args.threads, max_running=max(args.batches),
              spec_block_size=max(blocks))
    config = llm.model_config
    prompts, source = make_prompts(args.model, max(args.batches + [args.min_prompts]), args.prompt_len, args.seed,
                                   config.vocab_size, list(config.eos_token_id))
    print(f"draft block size {draft_block}; block sizes measured: {blocks}"
          + (f" (skipped {skipped}: larger than the draft's block)" if skipped else "") + "\n", flush=True)
    table = Table(f"speculative decoding, greedy, prompt {args.prompt_len} + {args.new_tokens} new tokens ({source})",
                  ["batch", "prompts", "off tok/s"]
                  + [c for b in blocks for c in (f"B={b} tok/s", f"B={b} speed-up", f"B={b} CPU speed-up",
                                                  f"B={b} accept len")]
                  + ["identical"])
    split = Table("one decode step, split (ms; step = mean decode-step wall time, forwards = medians of the run's "
                  "target / draft forward calls, rest = step - target - draft: planning, sampling, verification, "
                  "bookkeeping)", ["batch", "variant", "step ms", "target forward ms", "draft forward ms", "rest ms",
                                   "step / plain step"])
    timers = (ForwardTimer(llm.engine.runner, "forward_target"), ForwardTimer(llm.engine.runner, "forward_draft"))
    single: dict[int, float] = {}
    for batch in args.batches:
        outputs: dict[str, list] = {}
        batch_prompts = prompts[: batch * max(1, args.min_prompts // batch)]
        variants = {"off": spec_variant(llm, batch_prompts, batch, SamplingParams(
            max_new_tokens=args.new_tokens, temperature=0.0, ignore_eos=True, speculative=False), outputs, "off", timers)}
        for block in blocks:
            params = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0, ignore_eos=True,
                                    speculative=True, block_size=block)
            variants[f"B={block}"] = spec_variant(llm, batch_prompts, batch, params, outputs, f"B={block}", timers)
        runs = interleave(variants, args.repeats)
        off, off_cpu = median(runs["off"], "tok_s"), median(runs["off"], "cpu_tok_s")
        cells: list[object] = [batch, off]
        for block in blocks:
            on, on_cpu = median(runs[f"B={block}"], "tok_s"), median(runs[f"B={block}"], "cpu_tok_s")
            cells += [on, f"{ratio(on, off):.2f}x", f"{ratio(on_cpu, off_cpu):.2f}x",
                      median(runs[f"B={block}"], "accept_len")]
            if batch == 1:
                single[block] = ratio(on, off)
        plain_step = median(runs["off"], "step_ms")
        for name, samples in runs.items():
            step, target, draft = (median(samples, key) for key in ("step_ms", "target_ms", "draft_ms"))
            split.add(batch, name, step, target, draft, step - target - draft, f"{ratio(step, plain_step):.2f}x")
        same = sum(all(outputs[f"B={b}"][i] == outputs["off"][i] for b in blocks)
                   for i in range(len(batch_prompts)))
        cells.append(f"{same}/{len(batch_prompts)}")
        table.add(batch, len(batch_prompts), *cells[1:])
        print(f"batch {batch} done", flush=True)
    print()
    table.print()
    split.print()
    stats = llm.acceptance_stats
    rates = ", ".join(f"{rate:.2f}" for rate in stats.per_position_acceptance)
    print(f"per-position acceptance over every verify step of this run (all block sizes): {rates}\n")
    if single:
        best = max(single, key=single.get)
        print("## Goals\n")
        print(f"- {goal_line(f'single-stream speed-up (issue 4; best block size B={best})', single[best], 2.0)}")
        if 8 in single:
            print(f"- {goal_line('single-stream speed-up at B=8', single[8], 2.0)}")
    llm.close()


if __name__ == "__main__":
    main()
