"""Validation of a KimiLinearConfig: every unsupported value is a ValueError naming its field."""
from __future__ import annotations

from typing import TYPE_CHECKING

from engine.config_base import (
    MLA_OPTIONAL_POSITIVE, MLA_POSITIVE, check_expert_groups, check_int_fields, check_positive,
)

if TYPE_CHECKING:
    from engine.model_configs.kimi_linear import KimiLinearConfig

_POSITIVE = MLA_POSITIVE + (
    "vocab_size", "num_hidden_layers", "max_position_embeddings", "intermediate_size", "moe_layer_freq",
    "num_experts", "num_experts_per_token", "moe_intermediate_size", "num_expert_group", "topk_group",
)
_NON_NEGATIVE = ("first_k_dense_replace", "num_shared_experts", "num_nextn_predict_layers")
_OPTIONAL_POSITIVE = MLA_OPTIONAL_POSITIVE + ("routed_expert_hidden_size", "attn_res_block_size")


def check_kimi_config(c: KimiLinearConfig) -> None:
    from engine.model_configs.kimi_linear import HIDDEN_ACTS, MODEL_TYPES, SSM_DTYPES

    if c.model_type not in MODEL_TYPES:
        raise ValueError(f"model_type must be one of {MODEL_TYPES}, got {c.model_type!r}")
    check_int_fields(c, _POSITIVE, _NON_NEGATIVE, _OPTIONAL_POSITIVE)
    c.linear_attn.check_layers(c.num_hidden_layers)
    if not c.mla_use_nope:
        raise ValueError("mla_use_nope=false (rotary MLA in a Kimi model) is not supported")
    if c.hidden_act not in HIDDEN_ACTS:
        raise ValueError(f"hidden_act must be one of {HIDDEN_ACTS}, got {c.hidden_act!r}")
    if c.hidden_act == "situ":
        for name in ("activation_situ_beta", "activation_situ_linear_beta"):
            value = getattr(c, name)
            if value is None or not value > 0:
                raise ValueError(f"{name} must be a positive number when hidden_act is 'situ', got {value!r}")
    if c.moe_router_activation_func != "sigmoid":
        raise ValueError(f"moe_router_activation_func must be 'sigmoid', got {c.moe_router_activation_func!r}")
    if c.topk_method != "noaux_tc":
        raise ValueError(f"topk_method must be 'noaux_tc', got {c.topk_method!r}")
    check_expert_groups(c, "num_experts", "num_experts_per_token", "num_expert_group")  # noaux_tc (checked above)
    if c.latent_moe_use_norm and c.routed_expert_hidden_size is None:
        raise ValueError("latent_moe_use_norm=true needs routed_expert_hidden_size")
    if c.num_nextn_predict_layers:
        raise ValueError(f"num_nextn_predict_layers={c.num_nextn_predict_layers}: MTP layers are not supported")
    if c.mamba_ssm_dtype not in SSM_DTYPES:
        raise ValueError(f"mamba_ssm_dtype must be one of {sorted(SSM_DTYPES)}, got {c.mamba_ssm_dtype!r}")
    check_positive(c, ("rms_norm_eps", "routed_scaling_factor"))
    if c.model_type == "kimi_linear":
        _check_kimi_linear_only(c)


def _check_kimi_linear_only(c: KimiLinearConfig) -> None:
    """The kimi_linear model (transformers' architecture) has none of K3's extra parts."""
    k3_only = {
        "routed_expert_hidden_size": c.routed_expert_hidden_size is not None,
        "attn_res_block_size": c.attn_res_block_size is not None,
        "mla_use_output_gate": c.mla_use_output_gate,
        "hidden_act": c.hidden_act != "silu",
        "quantization_config": c.quantization is not None,
        "linear_attn_config.use_full_rank_gate": c.linear_attn.use_full_rank_gate,
    }
    for name, used in k3_only.items():
        if used:
            raise ValueError(f"{name}: a Kimi K3 feature, not supported with model_type 'kimi_linear' "
                             "(use model_type 'kimi_k3')")
