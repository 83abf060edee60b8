"""Engine vs HF transformers on the same checkpoint, in one run (issue 2; issue 7 (c), (e), (f)).

Tables (interleaved repetitions, medians; float32 both sides, greedy, ignore eos, same prompts):
  decode       LLM engine (speculation off) vs transformers DeepseekV3ForCausalLM.generate (eager attention,
               torch.inference_mode) at batch 1 and 16, plus the engine alone at larger batches (its peak)
  utilisation  the engine's decode-step FLOP/s (analytic FLOPs per token from config.json) vs this CPU's
               measured matmul peak (torch.matmul, large square float32 / bfloat16, same threads)
  prefill      1024-token prompts: engine (LLM.generate with 1 new token) vs transformers forward
  long         cold prefill of one --long-len prompt: TTFT and tok/s per attention backend that runs here
Engine rows run LLM.engine's step loop (the loop of LLM.generate) with per-step timing.

Run: .venv/bin/python -m benchmarks.bench_engine [--model DIR] [--quick]
"""
from __future__ import annotations

import argparse
import time

import torch

from benchmarks.common import (Table, add_common_arguments, goal_line, interleave, load_note, make_prompts,
                               median, paired, print_header, ratio, spread, timed_generate)
from engine import LLM, SamplingParams
from engine.model_configs.model_config import ModelConfig


def decode_flops_per_token(c: ModelConfig, context: float) -> float:
    """2 x the weights a decode token touches (q/kv/o projections, dense MLPs, router + top-k + shared
    experts, LM head) + absorbed-MLA attention over `context` cached tokens (scores over latent + rope,
    output over latent)."""
    h, heads = c.hidden_size, c.num_attention_heads
    qk = c.qk_nope_head_dim + c.qk_rope_head_dim
    q = h * c.q_lora_rank + c.q_lora_rank * heads * qk if c.q_lora_rank else h * heads * qk
    attention = (q + h * (c.kv_lora_rank + c.qk_rope_head_dim)
                 + c.kv_lora_rank * heads * (c.qk_nope_head_dim + c.v_head_dim) + heads * c.v_head_dim * h)
    dense = 3 * h * c.intermediate_size
    moe = h * c.n_routed_experts + (c.num_experts_per_tok + c.n_shared_experts) * 3 * h * c.moe_intermediate_size
    weights = sum(attention + (moe if c.is_moe_layer(i) else dense) for i in range(c.num_hidden_layers))
    weights += h * c.vocab_size
    per_layer_context = 2 * heads * context * (2 * c.kv_lora_rank + c.qk_rope_head_dim)
    return 2.0 * weights + c.num_hidden_layers * per_layer_context


def matmul_peak(size: int, dtype: torch.dtype, repeats: int) -> tuple[float, float]:
    """(best, median) FLOP/s of torch.matmul on [size, size] matrices."""
    a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
    torch.matmul(a, b)
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.matmul(a, b)
        rates.append(2 * size**3 / (time.perf_counter() - start))
    return max(rates), sorted(rates)[len(rates) // 2]


def hf_model(model_dir, experts: str):
    from transformers import DeepseekV3ForCausalLM, GenerationConfig

    model = DeepseekV3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager",
                                                  experts_implementation=experts).eval()
    return model, GenerationConfig


def hf_generate(model, generation_config_cls, prompts: list[list[int]], new_tokens: int) -> tuple[float, list]:
    """transformers greedy generate, eos disabled (ignore_eos); returns (seconds, new tokens per prompt)."""
    ids = torch.tensor(prompts)
    config = generation_config_cls(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
        seconds = time.perf_counter() - start
    return seconds, out[:, ids.shape[1]:].tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_arguments(parser, repeats=3)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 128, 256], help="engine batch sizes")
    parser.add_argument("--prefill-len", type=int, default=1024)
    parser.add_argument("--prefill-batch", type=int, default=4)
    parser.add_argument("--long-len", type=int, default=16384, help="long-prompt tokens (capped at the context)")
    parser.add_argument("--long-repeats", type=int, default=1)
    parser.add_argument("--hf-experts", default="eager", help="transformers experts_implementation")
    parser.add_argument("--matmul-size", type=int, default=2048)
    parser.add_argument("--skip", nargs="*", default=[], choices=["decode", "prefill", "long"])
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.new_tokens, args.long_repeats = 1, min(args.new_tokens, 32), 1
        args.batches = [b for b in args.batches if b <= 64]
    print_header("bench_engine: pdserve engine vs transformers", args)
    llm = LLM(str(args.model), attention_backend="torch", draft_model="", num_threads=args.threads,
              max_running=max(args.batches + [16]))
    config = llm.model_config
    model, generation_config_cls = hf_model(args.model, args.hf_experts)
    avoid = list(config.eos_token_id)
    print(f"transformers: eager attention, experts_implementation={args.hf_experts!r}, float32\n", flush=True)
    results: dict = {}
    if "decode" not in args.skip:
        results = bench_decode(args, llm, model, generation_config_cls, config, avoid)
    if "prefill" not in args.skip:
        bench_prefill(args, llm, model, config, avoid)
    if "long" not in args.skip:
        bench_long(args, llm, config, avoid)
    if results:
        print("## Goals\n")
        print(f"- {goal_line('engine / transformers at batch 16 (issue 2)', results['b16'], 3.0)}")
        print(f"- {goal_line('engine / transformers at batch 16 (issue 7)', results['b16'], 2.0)}")
        print(f"- {goal_line('engine peak / transformers batch 16 (issue 2)', results['peak'], 10.0)}")
    llm.close()


def bench_decode(args, llm, model, generation_config_cls, config, avoid) -> dict:
    prompts, source = make_prompts(args.model, max(args.batches + [16]), args.prompt_len, args.seed,
                                   config.vocab_size, avoid)
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    engine_outputs: dict[int, list] = {}
    hf_outputs: dict[int, list] = {}

    def engine_variant(batch: int):
        def run():
            timed = timed_generate(llm.engine, prompts[:batch], params)
            engine_outputs[batch] = timed.outputs
            return timed.metrics()
        return run

    def hf_variant(batch: int):
        def run():
            seconds, outputs = hf_generate(model, generation_config_cls, prompts[:batch], args.new_tokens)
            hf_outputs[batch] = outputs
            return {"tok_s": batch * args.new_tokens / seconds}
        return run

    variants = {}
    for batch in sorted(set(args.batches) | {1, 16}):
        variants[f"engine {batch}"] = engine_variant(batch)
        if batch in (1, 16):
            variants[f"transformers {batch}"] = hf_variant(batch)
    runs = interleave(variants, args.repeats, warmup=["engine 16", "transformers 16"])
    table = Table(f"decode: greedy tok/s, prompt {args.prompt_len} + {args.new_tokens} new tokens ({source})",
                  ["batch", "engine tok/s", "transformers tok/s", "engine / transformers",
                   "per-round ratio, median (min..max)", "identical outputs", "load average"])
    for batch in (1, 16):
        same = sum(a == b for a, b in zip(engine_outputs[batch], hf_outputs[batch]))
        engine_runs, hf_runs = runs[f"engine {batch}"], runs[f"transformers {batch}"]
        engine_rate, hf_rate = median(engine_runs, "tok_s"), median(hf_runs, "tok_s")
        table.add(batch, engine_rate, hf_rate, f"{ratio(engine_rate, hf_rate):.2f}x",
                  spread(paired(engine_runs, hf_runs, "tok_s"), unit="x"), f"{same}/{batch}",
                  load_note({"engine": engine_runs, "transformers": hf_runs}))
    table.print()
    peak_flops, _ = matmul_peak(args.matmul_size, torch.float32, 5)
    bf16_peak, _ = matmul_peak(args.matmul_size, torch.bfloat16, 5)
    hf16 = median(runs["transformers 16"], "tok_s")
    sweep = Table(f"engine throughput and decode compute utilisation by batch size (float32; matmul peak "
                  f"{peak_flops / 1e9:.1f} GFLOP/s float32, {bf16_peak / 1e9:.1f} GFLOP/s bfloat16, "
                  f"{args.matmul_size}^2, {torch.get_num_threads()} threads)",
                  ["batch", "tok/s (end to end)", "decode-step tok/s", "ms / decode step", "TTFT p50 ms",
                   "decode GFLOP/s", "% of fp32 matmul peak", "vs transformers b16"])
    context = args.prompt_len + args.new_tokens / 2
    flops = decode_flops_per_token(config, context)
    best = 0.0
    for batch in sorted(set(args.batches) | {1, 16}):
        samples = runs[f"engine {batch}"]
        rate, decode_rate = median(samples, "tok_s"), median(samples, "decode_tok_s")
        best = max(best, rate)
        achieved = decode_rate * flops
        sweep.add(batch, rate, decode_rate, median(samples, "step_ms"), median(samples, "ttft_ms"), achieved / 1e9,
                  f"{100 * achieved / peak_flops:.1f}%", f"{ratio(rate, hf16):.2f}x")
    sweep.print()
    print(f"FLOPs per decode token at context {context:.0f}: {flops / 1e6:.2f} MFLOP (analytic, from config.json)\n")
    return {"b16": ratio(median(runs["engine 16"], "tok_s"), hf16), "peak": ratio(best, hf16)}


def bench_prefill(args, llm, model, config, avoid) -> None:
    prompts, source = make_prompts(args.model, args.prefill_batch, args.prefill_len, args.seed + 1,
                                   config.vocab_size, avoid)
    params = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    tokens = args.prefill_batch * args.prefill_len

    def engine_run():
        start = time.perf_counter()
        llm.generate(prompts, params)
        return {"tok_s": tokens / (time.perf_counter() - start)}

    def hf_run():
        ids = torch.tensor(prompts)
        with torch.inference_mode():
            start = time.perf_counter()
            model(input_ids=ids, logits_to_keep=1)
            return {"tok_s": tokens / (time.perf_counter() - start)}

    runs = interleave({"engine": engine_run, "transformers": hf_run}, args.repeats)
    table = Table(f"prefill: {args.prefill_batch} prompts x {args.prefill_len} tokens ({source})",
                  ["", "engine tok/s", "transformers tok/s", "engine / transformers"])
    engine_rate, hf_rate = median(runs["engine"], "tok_s"), median(runs["transformers"], "tok_s")
    table.add("prefill", engine_rate, hf_rate, f"{ratio(engine_rate, hf_rate):.2f}x")
    table.print()


def bench_long(args, llm, config, avoid) -> None:
    length = min(args.long_len, config.max_position_embeddings - 1)
    prompts, source = make_prompts(args.model, 1, length, args.seed + 2, config.vocab_size, avoid)
    params = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    table = Table(f"cold prefill of one {length}-token prompt ({source}; chunks of "
                  f"{llm.engine.config.max_batched_tokens} tokens)",
                  ["attention backend", "TTFT s", "prefill tok/s"])
    runs = interleave({"torch": lambda: timed_generate(llm.engine, prompts, params).metrics()},
                      args.long_repeats, warmup=False)
    ttft = median(runs["torch"], "ttft_ms") / 1e3
    table.add("torch", ttft, length / ttft)
    table.add("triton", "interpreter only on CPU, not timed", "-")
    table.add("aiter", "ROCm only, not available here", "-")
    table.print()


if __name__ == "__main__":
    main()
