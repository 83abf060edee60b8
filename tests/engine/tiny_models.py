"""Tiny random DeepSeek-V3 checkpoints written by transformers itself (the reference implementation).

make_tiny_checkpoint(tmp_dir, variant, seed) -> model directory (config.json + model.safetensors, float32).
Variants:
  yarn       q_lora, YaRN rope (mscale_all_dim != 0), interleaved rope; config.json rewritten in the
             transformers v4 layout (rope_theta + rope_scaling at top level), as DeepSeek-V3 ships it
  no_q_lora  plain q_proj (DeepSeek-V2-Lite style), default rope, non-interleaved, tied embeddings
  grouped    n_group=4, topk_group=2, 16 experts, top-4
  heads24    24 heads (12 per rank at TP=2), yarn without mscale_all_dim
Every MoE router gets a non-zero e_score_correction_bias so its selection-only use is exercised.

Also here: DEEPSEEK_V3_CONFIG (the real model's config.json, v4 layout) and PagedRunner, which drives
an engine model over growing sequences in a paged latent cache (prefill, chunks, decode steps).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

VARIANTS = ("yarn", "no_q_lora", "grouped", "heads24")

_BASE: dict[str, Any] = dict(
    vocab_size=320, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
    v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1,
    first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=2.5, max_position_embeddings=512,
    rms_norm_eps=1e-6, initializer_range=0.1, tie_word_embeddings=False, rope_interleave=True,
    bos_token_id=0, eos_token_id=1,
)
_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
         "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.7}

_VARIANTS: dict[str, dict[str, Any]] = {
    "yarn": dict(rope_parameters=_YARN),
    "no_q_lora": dict(q_lora_rank=None, rope_interleave=False, tie_word_embeddings=True,
                      rope_parameters={"rope_type": "default", "rope_theta": 5000.0}),
    "grouped": dict(n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=2,
                    num_hidden_layers=2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "heads24": dict(num_attention_heads=24, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, kv_lora_rank=16,
                    num_hidden_layers=2, rope_parameters={**_YARN, "mscale_all_dim": 0, "mscale": 0}),
}


# DeepSeek-V3's own config.json (v4 layout), trimmed to what the engine reads.
DEEPSEEK_V3_CONFIG: dict[str, Any] = {
    "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536,
    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "n_routed_experts": 256, "num_experts_per_tok": 8, "n_shared_experts": 1, "first_k_dense_replace": 3,
    "moe_layer_freq": 1, "n_group": 8, "topk_group": 4, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
    "norm_topk_prob": True, "routed_scaling_factor": 2.5, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "max_position_embeddings": 163840, "hidden_act": "silu", "bos_token_id": 0, "eos_token_id": 1,
    "rope_theta": 10000, "attention_bias": False, "num_nextn_predict_layers": 1,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
}


def tiny_config_kwargs(variant: str) -> dict[str, Any]:
    """The DeepseekV3Config keyword arguments of a variant."""
    if variant not in _VARIANTS:
        raise ValueError(f"unknown tiny variant {variant!r}; choose from {VARIANTS}")
    kwargs = {**_BASE, **_VARIANTS[variant]}
    kwargs["num_key_value_heads"] = kwargs["num_attention_heads"]  # MLA: every head has its own k/v
    return kwargs


def _to_v4_layout(config_path: Path) -> None:
    """Rewrites a v5 config.json (rope_parameters) as v4 (rope_theta + rope_scaling with "type")."""
    d = json.loads(config_path.read_text())
    rope = dict(d.pop("rope_parameters"))
    d["rope_theta"] = rope.pop("rope_theta")
    rope["type"] = rope.pop("rope_type")
    d["rope_scaling"] = rope
    config_path.write_text(json.dumps(d, indent=2))


def make_tiny_checkpoint(tmp_dir: str | Path, variant: str, seed: int = 0) -> Path:
    """Builds transformers' DeepseekV3ForCausalLM with a fixed seed and saves it (float32) under tmp_dir/variant-seed."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    out = Path(tmp_dir) / f"{variant}-{seed}"
    if (out / "config.json").exists():
        return out
    torch.manual_seed(seed)
    config = DeepseekV3Config(**tiny_config_kwargs(variant))
    model = DeepseekV3ForCausalLM(config).float().eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=generator) * 0.05)
    model.save_pretrained(out)
    if variant == "yarn":
        _to_v4_layout(out / "config.json")
    return out


class PagedRunner:
    """Drives an engine model over sequences that grow step by step in a paged latent cache.

    step() feeds each listed sequence its next tokens (positions continue where it stopped) and
    returns the float32 logits [num_new_tokens, vocab] of every new token plus the ModelOutput."""

    def __init__(self, model: Any, config: Any, num_pages: int = 64, page_size: int = 16) -> None:
        from engine.cache.kv_cache import CacheShape, PageAllocator, PagedLatentCache

        shape = CacheShape(config.num_hidden_layers, num_pages, page_size, config.kv_lora_rank,
                           config.qk_rope_head_dim, model.dtype)
        self.model = model
        self.cache = PagedLatentCache(shape)
        self.allocator = PageAllocator(num_pages)
        self.allocator.allocate(1)  # page 0 stays unused, so a zero block-table entry is never real context
        self.page_size = page_size
        self.tables: dict[int, Any] = {}
        self.lengths: dict[int, int] = {}

    def step(self, mode: Any, chunks: list[tuple[int, list[int]]], capture_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, Any]:
        from engine.runtime.forward_batch import ForwardBatch, build_attention_metadata
        from engine.cache.kv_cache import PageTable

        q_lens, kv_lens, pages, ids, positions = [], [], [], [], []
        for seq, tokens in chunks:
            table = self.tables.setdefault(seq, PageTable(self.allocator, self.page_size))
            start = self.lengths.get(seq, 0)
            table.ensure(start + len(tokens))
            self.lengths[seq] = start + len(tokens)
            q_lens.append(len(tokens))
            kv_lens.append(start + len(tokens))
            pages.append(list(table.pages))
            ids += tokens
            positions += range(start, start + len(tokens))
        metadata = build_attention_metadata(q_lens, kv_lens, pages, self.page_size)
        batch = ForwardBatch(mode, torch.tensor(ids), torch.tensor(positions), metadata)
        with torch.no_grad():
            out = self.model(batch, self.cache, capture_layers)
            return self.model.compute_logits(out.hidden), out
