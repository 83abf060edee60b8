"""Model presets: HF config.json fields of well-known models (DeepSeek-V3 architecture, Kimi K3) and how they ship."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdserve.plan.dtypes import Quantization, weight_format
from pdserve.plan.hybrid import HybridAttention
from pdserve.plan.kimi_k3_config import KIMI_K3_CONFIG


@dataclass(frozen=True)
class Preset:
    """hf_config is a whole config.json (Kimi K3: text_config nested); parameter counts are computed from it
    like any config.json, never stored. quantization / hybrid None: read from hf_config."""

    name: str
    description: str
    hf_config: dict[str, Any]
    quantization: Quantization | None = None
    hybrid: HybridAttention | None = None


_DEEPSEEK_V3 = {
    "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "num_attention_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 256,
    "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3, "n_group": 8, "topk_group": 4,
}
_KIMI_K2 = dict(_DEEPSEEK_V3, vocab_size=163840, num_attention_heads=64, n_routed_experts=384,
                first_k_dense_replace=1, n_group=1, topk_group=1)
_FP8 = Quantization(weight_format("fp8"), weight_format("fp8"))
_INT4_EXPERTS = Quantization(weight_format("bf16"), weight_format("int4", group_size=32, scale_dtype="bf16"))

PRESETS: dict[str, Preset] = {
    preset.name: preset
    for preset in (
        Preset("deepseek-v3", "DeepSeek-V3 (671B), FP8 weights as shipped", _DEEPSEEK_V3, _FP8),
        Preset("kimi-k2", "Kimi K2 (~1.03T), FP8 weights as shipped", _KIMI_K2, _FP8),
        Preset("kimi-k2-thinking", "Kimi K2-Thinking (~1.03T): int4 routed experts (group 32, bf16 scales), "
               "the rest bf16", _KIMI_K2, _INT4_EXPERTS),
        Preset("kimi-k3", "Kimi K3 (~2.8T) from its published config.json: 69 KDA + 24 gated MLA layers, "
               "LatentMoE with 896 routed experts top-16 in MXFP4, the rest bf16", KIMI_K3_CONFIG),
    )
}
