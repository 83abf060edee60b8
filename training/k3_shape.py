"""The K3-shaped default model's geometry and the config.json it is saved with (K3's real layout).

Layer kinds follow Kimi K3 at small scale: KDA and gated NoPE MLA 3:1 (every 4th layer, 1-indexed, is
MLA), layer 0 a dense SiTU MLP, every other layer a LatentMoE with SiTU and MXFP4 routed experts, Attention
Residuals with blocks of attn_res_block_size layers, 24 heads in both attention kinds (TP=2 gives 12 per
rank, which the MLA backends pad to 16).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.layers.mxfp4 import GROUP_SIZE

MLA_EVERY = 4  # KDA : MLA = 3 : 1


@dataclass(frozen=True)
class K3Shape:
    """Model shape. Widths divide by 2 (TP=2); MXFP4 expert inputs by 32."""

    vocab_size: int = 4096
    hidden_size: int = 192
    num_hidden_layers: int = 4
    num_heads: int = 24  # KDA heads and MLA heads
    kda_head_dim: int = 16
    q_lora_rank: int = 96
    kv_lora_rank: int = 64
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 16  # NoPE: the "rope" part is cached and used but never rotated
    v_head_dim: int = 16
    intermediate_size: int = 512  # dense layer 0
    num_experts: int = 8
    num_experts_per_token: int = 2
    num_shared_experts: int = 2
    moe_intermediate_size: int = 64
    routed_expert_hidden_size: int = 64  # the LatentMoE width
    attn_res_block_size: int = 2
    conv_width: int = 4
    gate_lower_bound: float = -5.0
    rms_norm_eps: float = 1e-5
    train_length: int = 256
    max_position_embeddings: int = 16384

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_heads", "intermediate_size", "num_experts",
                     "moe_intermediate_size", "routed_expert_hidden_size"):
            if getattr(self, name) % 2:
                raise ValueError(f"{name} must be divisible by 2 (TP=2), got {getattr(self, name)}")
        for name in ("moe_intermediate_size", "routed_expert_hidden_size"):
            if getattr(self, name) % GROUP_SIZE:
                raise ValueError(f"{name} must be a multiple of {GROUP_SIZE} (MXFP4 groups), got {getattr(self, name)}")
        if self.num_hidden_layers < MLA_EVERY:
            raise ValueError(f"num_hidden_layers must be >= {MLA_EVERY} (3 KDA + 1 MLA), got {self.num_hidden_layers}")
        if not 0 < self.num_experts_per_token <= self.num_experts:
            raise ValueError(f"num_experts_per_token must be in 1..{self.num_experts}")
        if self.attn_res_block_size <= 0:
            raise ValueError(f"attn_res_block_size must be positive, got {self.attn_res_block_size}")

    def is_mla(self, layer: int) -> bool:
        return (layer + 1) % MLA_EVERY == 0

    @property
    def kda_proj(self) -> int:
        return self.num_heads * self.kda_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def k3_config_dict(shape: K3Shape, bos_id: int, eos_id: int, pad_id: int) -> dict[str, Any]:
    """config.json in Kimi K3's published layout (text_config with 1-indexed layer lists, MXFP4 experts)."""
    layers = range(1, shape.num_hidden_layers + 1)
    text = {
        "model_type": "kimi_linear", "vocab_size": shape.vocab_size, "hidden_size": shape.hidden_size,
        "num_hidden_layers": shape.num_hidden_layers, "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_heads, "q_lora_rank": shape.q_lora_rank, "kv_lora_rank": shape.kv_lora_rank,
        "qk_nope_head_dim": shape.qk_nope_head_dim, "qk_rope_head_dim": shape.qk_rope_head_dim,
        "v_head_dim": shape.v_head_dim, "mla_use_nope": True, "mla_use_output_gate": True,
        "max_position_embeddings": shape.max_position_embeddings, "rms_norm_eps": shape.rms_norm_eps,
        "hidden_act": "situ", "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
        "intermediate_size": shape.intermediate_size, "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "num_experts": shape.num_experts, "num_experts_per_token": shape.num_experts_per_token,
        "num_shared_experts": shape.num_shared_experts, "moe_intermediate_size": shape.moe_intermediate_size,
        "routed_expert_hidden_size": shape.routed_expert_hidden_size, "latent_moe_use_norm": True,
        "moe_router_activation_func": "sigmoid", "topk_method": "noaux_tc", "use_grouped_topk": True,
        "num_expert_group": 1, "topk_group": 1, "moe_renormalize": True, "routed_scaling_factor": 1.0,
        "attn_res_block_size": shape.attn_res_block_size, "num_nextn_predict_layers": 0,
        "tie_word_embeddings": False, "bos_token_id": bos_id, "eos_token_id": eos_id, "pad_token_id": pad_id,
        "linear_attn_config": {
            "kda_layers": [i for i in layers if i % MLA_EVERY], "full_attn_layers": [i for i in layers if not i % MLA_EVERY],
            "num_heads": shape.num_heads, "head_dim": shape.kda_head_dim,
            "short_conv_kernel_size": shape.conv_width, "use_full_rank_gate": True,
            "gate_lower_bound": shape.gate_lower_bound,
        },
        "quantization_config": {
            "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                "num_bits": 4, "group_size": GROUP_SIZE, "type": "float", "strategy": "group"}}},
            "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*routed_expert_.*",
                       "re:.*mlp\\.(gate|up|down)_proj.*", "language_model.lm_head"],
        },
    }
    return {
        "model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"], "bos_token_id": bos_id,
        "eos_token_id": eos_id, "pad_token_id": pad_id, "tie_word_embeddings": False, "text_config": text,
    }
