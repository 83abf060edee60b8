"""Model presets: HF config.json fields of well-known DeepSeek-V3-architecture models and how they ship."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdserve.plan.dtypes import Quantization, weight_format
from pdserve.plan.hybrid import KIMI_K3_ATTENTION, HybridAttention


@dataclass(frozen=True)
class Preset:
    """hf_config holds the config.json fields the planner reads; parameter counts are computed from
    them like any config.json, never stored."""

    name: str
    description: str
    hf_config: dict[str, Any]
    quantization: Quantization
    hybrid: HybridAttention | None = None


_DEEPSEEK_V3 = {
    "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "num_attention_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 256,
    "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3, "n_group": 8, "topk_group": 4,
}
_KIMI_K2 = dict(_DEEPSEEK_V3, vocab_size=163840, num_attention_heads=64, n_routed_experts=384,
                first_k_dense_replace=1, n_group=1, topk_group=1)
# Not Moonshot's published K3 config: a DeepSeek-V3-architecture stand-in sized to the seed's figures
# (about 2.8T parameters, 96 heads, MLA latent 512 + 64, int4 experts -> about 1.56 TB). Its cache and
# state are K3's own: 24 MLA layers cache latents, 69 KDA layers hold a fixed-size state per request.
_KIMI_K3 = dict(_KIMI_K2, num_attention_heads=96, num_hidden_layers=62, n_routed_experts=1024)

_FP8 = Quantization(weight_format("fp8"), weight_format("fp8"))
_INT4_EXPERTS = Quantization(weight_format("bf16"), weight_format("int4", group_size=32, scale_dtype="bf16"))

PRESETS: dict[str, Preset] = {
    preset.name: preset
    for preset in (
        Preset("deepseek-v3", "DeepSeek-V3 (671B), FP8 weights as shipped", _DEEPSEEK_V3, _FP8),
        Preset("kimi-k2", "Kimi K2 (~1.03T), FP8 weights as shipped", _KIMI_K2, _FP8),
        Preset("kimi-k2-thinking", "Kimi K2-Thinking (~1.03T): int4 routed experts (group 32, bf16 scales), "
               "the rest bf16", _KIMI_K2, _INT4_EXPERTS),
        Preset("kimi-k3", "Kimi-K3-shaped (~2.8T, 96 heads): int4 routed experts (group 32, bf16 scales), "
               "the rest bf16; 24 MLA + 69 KDA layers", _KIMI_K3, _INT4_EXPERTS, KIMI_K3_ATTENTION),
    )
}
