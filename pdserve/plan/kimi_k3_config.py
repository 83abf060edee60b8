"""Kimi K3's config.json as published (moonshotai/Kimi-K3, restated from /work/shared/K3_SPEC.md section 1):
the fields that shape its weights, cache and state, in the checkpoint's own nesting (text_config holds the
kimi_linear decoder; the vision tower is left out - the planner serves text). The capacity planner parses
it with the engine's own K3 config parser, like any config.json."""
from __future__ import annotations

from typing import Any

_FULL_ATTN_LAYERS = [*range(4, 93, 4), 93]  # 1-indexed: 24 gated MLA layers (0-idx 3, 7, ..., 91 and 92)

KIMI_K3_TEXT_CONFIG: dict[str, Any] = {
    "model_type": "kimi_linear", "vocab_size": 163840, "hidden_size": 7168, "num_hidden_layers": 93,
    "num_attention_heads": 96, "num_key_value_heads": 96, "q_lora_rank": 1536, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "mla_use_nope": True,
    "mla_use_output_gate": True, "max_position_embeddings": 1048576, "rms_norm_eps": 1e-5, "hidden_act": "situ",
    "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0, "intermediate_size": 33792,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "num_experts": 896, "num_experts_per_token": 16,
    "num_shared_experts": 2, "moe_intermediate_size": 3072, "routed_expert_hidden_size": 3584,
    "latent_moe_use_norm": True, "moe_router_activation_func": "sigmoid", "topk_method": "noaux_tc",
    "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1, "moe_renormalize": True,
    "routed_scaling_factor": 1.0, "attn_res_block_size": 12, "num_nextn_predict_layers": 0,
    "tie_word_embeddings": False,
    "linear_attn_config": {
        "kda_layers": [i for i in range(1, 94) if i not in _FULL_ATTN_LAYERS], "full_attn_layers": _FULL_ATTN_LAYERS,
        "num_heads": 96, "head_dim": 128, "short_conv_kernel_size": 4, "use_full_rank_gate": True,
        "gate_lower_bound": -5.0,
    },
    "quantization_config": {
        "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "group_size": 32,
                                                                        "type": "float", "strategy": "group"}}},
        "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*routed_expert_.*",
                   "re:.*mlp\\.(gate|up|down)_proj.*", "language_model.lm_head"],
    },
}

KIMI_K3_CONFIG: dict[str, Any] = {
    "model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"], "bos_token_id": 163584,
    "eos_token_id": 163586, "pad_token_id": 163839, "media_placeholder_token_id": 163605,
    "tie_word_embeddings": False, "text_config": KIMI_K3_TEXT_CONFIG,
}
