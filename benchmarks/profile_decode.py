"""Profiles the engine's decode steps with torch.profiler: where a step's time goes, op by op, and how much
of it is model maths (the target forward) versus the engine around it (planning, metadata, sampling,
bookkeeping).

Prefills --batch prompts of --prompt-len tokens, runs --warmup decode steps, then profiles --steps decode
steps and prints (1) the step split: wall time of LLMEngine.step vs the time inside ModelRunner.forward_target
(both medians over the profiled steps), (2) torch.profiler's op table sorted by self CPU time.

Run: .venv/bin/python -m benchmarks.profile_decode --model DIR [--batch 16] [--steps 10] [--spec]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.common import ForwardTimer, add_common_arguments, make_prompts, print_header
from engine import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_arguments(parser, repeats=1)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--spec", action="store_true", help="speculation on (the model's draft)")
    parser.add_argument("--rows", type=int, default=30, help="op table rows")
    args = parser.parse_args()
    print_header("profile_decode: one decode step, op by op", args)
    llm = LLM(str(args.model), attention_backend="torch", draft_model=None if args.spec else "",
              num_threads=args.threads, max_running=max(16, args.batch))
    engine = llm.engine
    config = llm.model_config
    prompts, _ = make_prompts(args.model, args.batch, args.prompt_len, args.seed, config.vocab_size,
                              list(config.eos_token_id))
    per_step = 16 if args.spec else 1  # a verify step can emit up to a block of tokens
    params = SamplingParams(max_new_tokens=(args.warmup + args.steps + 8) * per_step, temperature=0.0, ignore_eos=True,
                            speculative=args.spec)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"profile-{i}", prompt, params)
    while engine.num_waiting:
        engine.step()
    for _ in range(args.warmup):
        engine.step()
    target = ForwardTimer(engine.runner, "forward_target")
    draft = ForwardTimer(engine.runner, "forward_draft") if args.spec else None
    steps: list[float] = []
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            start = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - start)
    step_ms = 1e3 * statistics.median(steps)
    forward_ms = 1e3 * statistics.median(target.samples)
    print(f"decode step (profiled, batch {args.batch}): {step_ms:.2f} ms median; target forward {forward_ms:.2f} ms "
          f"({100 * forward_ms / step_ms:.0f}%)", end="")
    if draft is not None and draft.samples:
        draft_ms = 1e3 * statistics.median(draft.samples)
        print(f"; draft forward {draft_ms:.2f} ms; the rest {step_ms - forward_ms - draft_ms:.2f} ms")
    else:
        print(f"; the rest {step_ms - forward_ms:.2f} ms")
    print()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
    while engine.has_work():
        engine.step()
    llm.close()


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
