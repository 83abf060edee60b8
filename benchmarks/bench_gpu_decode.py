"""Greedy decode throughput on one device: the engine with CUDA graphs, the engine eager, and
transformers, side by side in one run (interleaved repetitions, medians), at several batch sizes.
Writes JSON and a markdown table (for BENCHMARKS.md) and prints the goal lines:
engine (graphs) >= 5x transformers at batch 16; graphs >= 2x eager at batch 1.

    python benchmarks/bench_gpu_decode.py --model DIR [--device cuda] [--batches 1,16,64] [--json F] [--md F]

On CPU (the dry run) "graphs" and "eager" are the same engine path: graphs need a GPU."""
from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import torch

from benchmarks.common import Table, goal_line, interleave, median, ratio, timed_generate

logger = logging.getLogger("bench_gpu_decode")


def prompts_for(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (batch, length), generator=generator).tolist()


def engine_runner(llm, prompts: list[list[int]], new_tokens: int):
    from engine.sampling_params import SamplingParams

    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)

    def run() -> dict[str, float]:
        timed = timed_generate(llm.engine, prompts, params)
        return {"tok_s": timed.metrics()["decode_tok_s"], "total_tok_s": timed.metrics()["tok_s"]}

    return run


def hf_runner(model, prompts: list[list[int]], new_tokens: int, device: torch.device):
    from transformers import GenerationConfig

    ids = torch.tensor(prompts, device=device)
    config = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                              eos_token_id=None, pad_token_id=0)

    def run() -> dict[str, float]:
        with torch.inference_mode():
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds = time.perf_counter() - start
        new = (out.shape[1] - ids.shape[1]) * ids.shape[0]
        return {"tok_s": new / seconds, "total_tok_s": new / seconds}

    return run


def run_benchmark(args: argparse.Namespace) -> dict:
    from engine.llm import LLM

    device = torch.device(args.device)
    dtype = args.dtype
    max_batch = max(args.batches)
    common = dict(dtype=dtype, draft_model="", device=args.device, attention_backend=args.attention_backend,
                  max_running=max_batch, kv_memory_bytes=args.kv_memory_mb * 2**20)
    engines = {"engine graphs": LLM(args.model, use_graphs=True, **common),
               "engine eager": LLM(args.model, use_graphs=False, **common)}
    hf = None
    if not args.no_transformers:
        from transformers import DeepseekV3ForCausalLM

        hf = DeepseekV3ForCausalLM.from_pretrained(args.model, dtype=getattr(torch, dtype)).to(device).eval()
    vocab = engines["engine eager"].model_config.vocab_size
    results = {}
    for batch in args.batches:
        prompts = prompts_for(batch, args.prompt_len, vocab, seed=batch)
        variants = {name: engine_runner(llm, prompts, args.new_tokens) for name, llm in engines.items()}
        if hf is not None:
            variants["transformers"] = hf_runner(hf, prompts, args.new_tokens, device)
        samples = interleave(variants, args.repeats)
        results[batch] = {name: {"tok_s": median(s, "tok_s"), "samples": [m["tok_s"] for m in s]}
                          for name, s in samples.items()}
    for llm in engines.values():
        llm.close()
    return results


def render(results: dict, args: argparse.Namespace) -> tuple[str, list[str]]:
    table = Table(f"Greedy decode tok/s on {args.device_name} ({args.dtype}, prompt {args.prompt_len}, "
                  f"{args.new_tokens} new tokens, median of {args.repeats})",
                  ["batch", "engine graphs", "engine eager", "transformers", "graphs / eager", "engine / transformers"])
    for batch, row in results.items():
        graphs, eager = row["engine graphs"]["tok_s"], row["engine eager"]["tok_s"]
        hf = row.get("transformers", {}).get("tok_s", float("nan"))
        table.add(batch, graphs, eager, hf, ratio(graphs, eager), ratio(graphs, hf))
    goals = []
    if 16 in results and "transformers" in results[16]:
        goals.append(goal_line("engine decode vs transformers at batch 16", ratio(
            results[16]["engine graphs"]["tok_s"], results[16]["transformers"]["tok_s"]), 5.0))
    if 1 in results:
        goals.append(goal_line("graphs vs eager at batch 1", ratio(
            results[1]["engine graphs"]["tok_s"], results[1]["engine eager"]["tok_s"]), 2.0))
    return table.render(), goals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--kv-memory-mb", type=int, default=2048)
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--md", type=Path, default=None)
    args = parser.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args.device_name = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "CPU"
    results = run_benchmark(args)
    markdown, goals = render(results, args)
    print(markdown + "\n".join(goals), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"device": args.device_name, "dtype": args.dtype, "results": results,
                                         "goals": goals}, indent=2))
    if args.md:
        args.md.write_text(markdown + "\n" + "\n".join(f"- {g}" for g in goals) + "\n")


if __name__ == "__main__":
    main()
