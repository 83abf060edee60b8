"""Engine vs transformers on the 85M-parameter DeepSeek-V3-shaped random checkpoint (issue 18, deliverable 1).

Writes the checkpoint first when --model has none (benchmarks/write_random_checkpoint.py --shape 85m, float32,
with transformers' DeepseekV3Config): hidden 1024, 4 MoE layers, 24 heads, q_lora 256, kv_lora 128, 8 routed
experts top-2 (intermediate 512) + 1 shared, vocab 4096. Then greedy decode, float32 on both sides, --threads
torch threads, --prompt-len prompts (uniform random ids), --new-tokens new tokens, eos ignored, at each
--batches size: the engine (LLM step loop, speculation off, torch attention) and transformers
DeepseekV3ForCausalLM.generate (eager attention, inference_mode) take turns for --repeats rounds (the order
alternates each round) after one unrecorded warm-up of each.

Per batch size the table shows each side's median tok/s with its min-max spread, the ratio of the medians,
the median of the per-round ratios (each round's engine run against the transformers run beside it), whether
the transformers / engine ratio of the median CPU seconds per run (this process's CPU time: with one thread
the work each side does, whatever the neighbours do), whether the greedy outputs are identical, and the 1-minute load average seen at the end of the runs (min-max);
a batch whose runs saw a load average above the core count is marked LOADED (its figures are shared-machine
figures).

Run: .venv/bin/python -m benchmarks.bench_engine_85m [--model /tmp/pdserve-85m] [--repeats 5]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from benchmarks.bench_engine import hf_generate, hf_model
from benchmarks.common import Table, goal_line, interleave, make_prompts, print_header, ratio, spread, timed_generate
from engine import LLM, SamplingParams

GOALS = {1: 1.2, 16: 1.5}  # engine / transformers (issue 18)


def ensure_checkpoint(model_dir: Path, seed: int) -> None:
    if not (model_dir / "model.safetensors").is_file():
        from benchmarks.write_random_checkpoint import M85, write_checkpoint

        print(f"writing the 85M checkpoint to {model_dir} ...", flush=True)
        write_checkpoint(model_dir, M85, torch.float32, seed)


def with_load(run):
    """Wraps a variant: its metrics plus this process's CPU seconds for the run and the 1-minute load
    average when it ends."""

    def timed():
        start = time.process_time()
        metrics = run()
        metrics["cpu_s"] = time.process_time() - start
        metrics["load"] = os.getloadavg()[0]
        return metrics

    return timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=Path("/tmp/pdserve-85m"), help="checkpoint directory")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--hf-experts", default="eager", help="transformers experts_implementation")
    args = parser.parse_args()
    ensure_checkpoint(args.model, args.seed)
    print_header("bench_engine_85m: pdserve engine vs transformers, 85M DeepSeek-V3-shaped checkpoint", args)
    llm = LLM(str(args.model), attention_backend="torch", draft_model="", num_threads=args.threads,
              max_running=max(args.batches + [16]))
    config = llm.model_config
    model, generation_config_cls = hf_model(args.model, args.hf_experts)
    prompts, source = make_prompts(args.model, max(args.batches), args.prompt_len, args.seed, config.vocab_size,
                                   list(config.eos_token_id))
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    cores = os.cpu_count() or 1
    table = Table(f"greedy decode tok/s, prompt {args.prompt_len} + {args.new_tokens} new tokens ({source}), "
                  f"{args.threads} threads, median (min-max) of {args.repeats} interleaved rounds",
                  ["batch", "engine tok/s", "transformers tok/s", "ratio of medians", "median per-round ratio",
                   "CPU-time ratio", "identical", "load avg (min-max)", "machine"])
    reached: dict[int, float] = {}
    for batch in args.batches:
        outputs: dict[str, list] = {}

        def engine_run(batch=batch, outputs=outputs):
            timed = timed_generate(llm.engine, prompts[:batch], params)
            outputs["engine"] = timed.outputs
            return {"tok_s": timed.new_tokens / timed.total_s}

        def hf_run(batch=batch, outputs=outputs):
            seconds, new = hf_generate(model, generation_config_cls, prompts[:batch], args.new_tokens)
            outputs["hf"] = new
            return {"tok_s": batch * args.new_tokens / seconds}

        start = time.perf_counter()
        runs = interleave({"engine": with_load(engine_run), "transformers": with_load(hf_run)}, args.repeats)
        engine_rates = [m["tok_s"] for m in runs["engine"]]
        hf_rates = [m["tok_s"] for m in runs["transformers"]]
        loads = [m["load"] for m in runs["engine"] + runs["transformers"]]
        per_round = [e / h for e, h in zip(engine_rates, hf_rates)]
        cpu_ratio = statistics.median(m["cpu_s"] for m in runs["transformers"]) / statistics.median(
            m["cpu_s"] for m in runs["engine"])
        same = sum(a == b for a, b in zip(outputs["engine"], outputs["hf"]))
        reached[batch] = ratio(statistics.median(engine_rates), statistics.median(hf_rates))
        table.add(batch, spread(engine_rates), spread(hf_rates), f"{reached[batch]:.2f}x",
                  f"{statistics.median(per_round):.2f}x ({min(per_round):.2f}-{max(per_round):.2f})",
                  f"{cpu_ratio:.2f}x", f"{same}/{batch}", f"{min(loads):.1f}-{max(loads):.1f}",
                  f"LOADED (> {cores} cores)" if max(loads) > cores else "ok")
        print(f"batch {batch} done in {time.perf_counter() - start:.0f} s\n", flush=True)
        table.print()  # after every batch size, so a run cut short still shows what it measured
    print("## Goals (issue 18)\n")
    for batch, target in GOALS.items():
        if batch in reached:
            print(f"- {goal_line(f'engine / transformers at batch {batch}', reached[batch], target)}")
    llm.close()


if __name__ == "__main__":
    main()
