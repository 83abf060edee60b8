"""Decode step time against context length: a Kimi-K3-shaped model (3 KDA : 1 MLA layers, LatentMoE, MXFP4
experts, Attention Residuals) vs a DeepSeek-V3-shaped model (every layer MLA, SiLU MoE) of about the same
size, measured in one run. Also prints K3's MXFP4 resident bytes vs bf16 and K3's per-request state and
MLA-cache bytes at TP8 (from the real K3 config).

Each context length L: one sequence whose paged latent cache already holds L tokens (random latents: the
decode cost depends on the length, not the values; the KDA state is a fixed-size slot) takes one decode
step; the two models take turns (interleaved, --repeats rounds), each sample is the mean of --steps steps.
Goal: K3's step-time growth from the shortest to the longest context <= 1/3 of DeepSeek-V3's.

Run: PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_k3_decode.py [--contexts 1024,2048,4096,8192,16384]
     [--repeats 5] [--plot benchmarks/results/k3-decode.png]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.common import goal_line, interleave, machine_description
from engine.attention.torch_backend import TorchAttentionBackend
from engine.model_configs.model_config import ModelConfig
from engine.runtime.distributed import TPGroup
from engine.runtime.forward_batch import ForwardBatch, ForwardMode, build_attention_metadata
from engine.cache.kv_cache import CacheShape, PagedLatentCache
from engine.layers.mxfp4 import PackedExperts
from engine.model_configs.kimi_linear import KimiLinearConfig
from engine.models.deepseek_v3 import DeepseekV3ForCausalLM
from engine.models.kimi_k3 import KimiK3ForCausalLM
from engine.cache.state_pool import StatePool
from tests.engine.k3_checkpoint import K3_REAL_TEXT, k3_config

PAGE = 64
# Shared shapes: hidden 512, 8 layers, 8 MLA heads (latent 256 + 32), top-2 routing. K3 gets 28 latent-width
# experts to DSV3's 16 full-width ones, so both hold about 58M parameters.
MLA = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8, q_lora_rank=192,
           kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, vocab_size=2048,
           first_k_dense_replace=1, intermediate_size=1536, moe_intermediate_size=256)
K3_TEXT = dict(MLA, num_experts=28, num_experts_per_token=2, num_shared_experts=1, routed_expert_hidden_size=256,
               attn_res_block_size=3, linear_attn_config={"kda_layers": [1, 2, 3, 5, 6, 7], "full_attn_layers": [4, 8],
                                                          "num_heads": 8, "head_dim": 64})
DSV3 = dict(MLA, n_routed_experts=16, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
            rope_theta=10000.0, max_position_embeddings=32768)

def _randomise(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            std = 1.0 if "norm" in name or "embed" in name else 0.5 / max(param.shape[-1], 1) ** 0.5
            param.copy_(torch.randn(param.shape, generator=gen) * std + (1.0 if "norm" in name else 0.0))
        for module in model.modules():
            if isinstance(module, PackedExperts):
                for buffer in (module.w13_packed, module.w2_packed):
                    buffer.copy_(torch.randint(0, 256, buffer.shape, dtype=torch.uint8, generator=gen))
                for buffer in (module.w13_scale, module.w2_scale):
                    buffer.fill_(123)
    for layer in model.model.layers:
        if hasattr(layer.self_attn, "process_weights_after_loading"):
            layer.self_attn.process_weights_after_loading()


def build_models(max_context: int) -> dict[str, tuple[torch.nn.Module, PagedLatentCache]]:
    """Both models with random weights and a cache (plus a state pool for K3) holding max_context tokens."""
    attention = TorchAttentionBackend()
    k3_cfg = KimiLinearConfig.from_hf_dict(k3_config(**K3_TEXT))
    ds_cfg = ModelConfig.from_hf_dict(DSV3)
    k3 = KimiK3ForCausalLM(k3_cfg, TPGroup(), attention, torch.float32)
    ds = DeepseekV3ForCausalLM(ds_cfg, TPGroup(), attention, torch.float32)
    pages = max_context // PAGE + 2
    out = {}
    for name, model, layers in (("K3-shaped", k3, k3_cfg.num_cache_layers), ("DSV3-shaped", ds, ds_cfg.num_hidden_layers)):
        _randomise(model, seed=len(name))
        model.eval().requires_grad_(False)
        state = StatePool(k3_cfg.state_shape(1, 1, torch.float32)) if name == "K3-shaped" else None
        cache = PagedLatentCache(CacheShape(layers, pages, PAGE, 256, 32, torch.float32), state=state)
        cache.kv.normal_(0, 1)
        if state is not None:
            state.alloc()
        out[name] = (model, cache)
    return out


def parameter_count(model: torch.nn.Module) -> int:
    """Parameters (MXFP4 experts counted as 2 weights per packed byte)."""
    count = sum(p.numel() for p in model.parameters())
    for module in model.modules():
        if isinstance(module, PackedExperts):
            count += 2 * (module.w13_packed.numel() + module.w2_packed.numel())
    return count


def decode_step(model: torch.nn.Module, cache: PagedLatentCache, context: int, steps: int) -> Callable[[], dict[str, float]]:
    """A closure timing `steps` decode steps of one sequence whose context is `context` tokens."""
    pages = list(range(1, context // PAGE + 2))
    metadata = build_attention_metadata([1], [context], [pages], PAGE)
    batch = ForwardBatch(ForwardMode.DECODE, torch.tensor([7]), torch.tensor([context - 1]), metadata,
                         state_slots=torch.tensor([0]) if cache.state is not None else None)

    def run() -> dict[str, float]:
        with torch.no_grad():
            start = time.perf_counter()
            for _ in range(steps):
                model.compute_logits(model(batch, cache).hidden)
            return {"ms": 1e3 * (time.perf_counter() - start) / steps}

    return run


def k3_sizes() -> list[str]:
    """K3's MXFP4 resident bytes per expert vs bf16, state bytes per request and MLA cache bytes per token at TP8."""
    experts = PackedExperts(1, 3584, 3072)
    real = KimiLinearConfig.from_hf_dict(k3_config(**K3_REAL_TEXT))
    state = real.state_shape(8, 1, torch.bfloat16).bytes_per_slot
    mla = real.num_mla_layers * real.kv_cache_dim * 2
    return [
        f"MXFP4 routed expert (3 x [3072, 3584]): {experts.resident_bytes:,} B packed vs {experts.bf16_bytes():,} B bf16 "
        f"= {100 * experts.resident_bytes / experts.bf16_bytes():.1f}%",
        goal_line("MXFP4 bytes / bf16 bytes", 100 * experts.resident_bytes / experts.bf16_bytes(), 30, "%", False),
        f"K3 KDA state per request per rank at TP8 (bf16 conv, fp32 SSM, {real.num_kda_layers} layers): "
        f"{state:,} B = {state / 2**20:.1f} MiB",
        f"K3 MLA cache ({real.num_mla_layers} layers x {real.kv_cache_dim} x bf16): {mla:,} B per token per rank",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--contexts", default="1024,2048,4096,8192,16384")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="decode steps per sample")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--plot", type=Path, default=Path("benchmarks/results/k3-decode.png"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    contexts = [int(c) for c in args.contexts.split(",")]
    print("# Decode step time vs context: K3-shaped vs DeepSeek-V3-shaped\n")
    print(f"machine: {machine_description()}  ")
    models = build_models(max(contexts))
    for name, (model, _) in models.items():
        print(f"{name}: {parameter_count(model) / 1e6:.1f}M parameters  ")
    print(f"repeats: {args.repeats} interleaved rounds x {args.steps} steps; batch 1, float32, torch attention\n")
    print("| context | K3 ms (median, min-max) | DSV3 ms (median, min-max) | load avg |")
    print("|---|---|---|---|")
    medians: dict[str, list[float]] = {name: [] for name in models}
    for context in contexts:
        variants = {name: decode_step(model, cache, context, args.steps) for name, (model, cache) in models.items()}
        samples = interleave(variants, args.repeats)
        cells = []
        for name in models:
            values = [s["ms"] for s in samples[name]]
            medians[name].append(statistics.median(values))
            cells.append(f"{medians[name][-1]:.2f} ({min(values):.2f}-{max(values):.2f})")
        print(f"| {context} | {cells[0]} | {cells[1]} | {os.getloadavg()[0]:.1f} |", flush=True)
    growth = {name: values[-1] - values[0] for name, values in medians.items()}
    print(f"\ngrowth {contexts[0]} -> {contexts[-1]}: " + ", ".join(f"{n} {g:+.2f} ms" for n, g in growth.items()))
    share = growth["K3-shaped"] / growth["DSV3-shaped"] if growth["DSV3-shaped"] > 0 else float("nan")
    print(goal_line("K3 growth / DSV3 growth", share, 1 / 3, "", higher_is_better=False) + "\n")
    for line in k3_sizes():
        print(line + "  ")
    _plot(args.plot, contexts, medians)


def _plot(path: Path, contexts: list[int], medians: dict[str, list[float]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, values in medians.items():
        ax.plot(contexts, values, marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context tokens")
    ax.set_ylabel("decode step ms (median)")
    ax.set_title("Decode step time vs context (CPU, batch 1)")
    ax.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    print(f"\nplot: {path}")


if __name__ == "__main__":
    main()
