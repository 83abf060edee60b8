"""config.json -> KimiLinearConfig's fields for transformers' flat kimi_linear layout and K3's nested layout.

kimi_linear: every field at the top level; transformers writes some under other names
(model_max_length, num_experts / num_local_experts, ...), and its mlp_layer_types / layer_types.
kimi_k3: the decoder fields in text_config (itself model_type "kimi_linear"); token ids and the
media placeholder at the top level override the text_config's; quantization_config may sit in either.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine.model_configs.linear_attn import LinearAttnConfig
from engine.model_configs.quantization import QuantizationConfig

_REQUIRED = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim",
    "qk_rope_head_dim", "v_head_dim", "intermediate_size", "moe_intermediate_size",
)
# (field, accepted config.json spellings in order, default when absent); defaults follow transformers'
# KimiLinearConfig / SGLang's KimiLinearConfig.
_FIELDS: tuple[tuple[str, tuple[str, ...], Any], ...] = (
    ("q_lora_rank", ("q_lora_rank",), None),
    ("mla_use_nope", ("mla_use_nope",), True),
    ("mla_use_output_gate", ("mla_use_output_gate",), False),
    ("max_position_embeddings", ("max_position_embeddings", "model_max_length"), 1048576),
    ("rms_norm_eps", ("rms_norm_eps",), 1e-5),
    ("hidden_act", ("hidden_act",), "silu"),
    ("activation_situ_beta", ("activation_situ_beta",), None),
    ("activation_situ_linear_beta", ("activation_situ_linear_beta",), None),
    ("first_k_dense_replace", ("first_k_dense_replace",), 1),
    ("moe_layer_freq", ("moe_layer_freq",), 1),
    ("num_experts", ("num_experts", "num_local_experts", "n_routed_experts"), None),
    ("num_experts_per_token", ("num_experts_per_token", "num_experts_per_tok"), 8),
    ("num_shared_experts", ("num_shared_experts", "n_shared_experts"), 1),
    ("routed_expert_hidden_size", ("routed_expert_hidden_size",), None),
    ("latent_moe_use_norm", ("latent_moe_use_norm",), False),
    ("moe_router_activation_func", ("moe_router_activation_func", "scoring_func"), "sigmoid"),
    ("topk_method", ("topk_method",), "noaux_tc"),
    ("use_grouped_topk", ("use_grouped_topk",), True),
    ("num_expert_group", ("num_expert_group", "n_group"), 1),
    ("topk_group", ("topk_group",), 1),
    ("moe_renormalize", ("moe_renormalize", "norm_topk_prob"), True),
    ("routed_scaling_factor", ("routed_scaling_factor",), 1.0),
    ("attn_res_block_size", ("attn_res_block_size",), None),
    ("num_nextn_predict_layers", ("num_nextn_predict_layers",), 0),
    ("tie_word_embeddings", ("tie_word_embeddings",), False),
    ("bos_token_id", ("bos_token_id",), None),
    ("eos_token_id", ("eos_token_id",), None),
    ("pad_token_id", ("pad_token_id",), None),
    ("media_placeholder_token_id", ("media_placeholder_token_id",), None),
    ("mamba_ssm_dtype", ("mamba_ssm_dtype",), "float32"),
)
_TOP_LEVEL_OVERRIDES = ("bos_token_id", "eos_token_id", "pad_token_id", "media_placeholder_token_id",
                        "tie_word_embeddings")


def read_config_json(model_dir: str | Path) -> dict[str, Any]:
    with (Path(model_dir) / "config.json").open() as f:
        return json.load(f)


def _first(d: dict[str, Any], names: tuple[str, ...], default: Any) -> Any:
    for name in names:
        if d.get(name) is not None:
            return d[name]
    return default


Fields = tuple[dict[str, Any], list[str] | None]  # KimiLinearConfig's fields, transformers' mlp_layer_types


def _text_fields(d: dict[str, Any], model_type: str, top: dict[str, Any]) -> Fields:
    missing = [key for key in _REQUIRED if d.get(key) is None]
    if missing:
        raise ValueError(f"config.json lacks required field(s): {', '.join(missing)}")
    if d.get("attention_bias"):
        raise ValueError("attention_bias=true is not supported")
    heads, kv_heads = d["num_attention_heads"], d.get("num_key_value_heads")
    if kv_heads is not None and kv_heads != heads:
        raise ValueError(f"num_key_value_heads={kv_heads} must equal num_attention_heads={heads} (MLA)")
    values: dict[str, Any] = {key: d[key] for key in _REQUIRED}
    for field, names, default in _FIELDS:
        values[field] = _first(d, names, default)
        if field in _TOP_LEVEL_OVERRIDES and top.get(field) is not None:
            values[field] = top[field]
    if values["num_experts"] is None:
        raise ValueError("config.json lacks required field: num_experts")
    eos = values["eos_token_id"]
    values["eos_token_id"] = () if eos is None else (int(eos),) if isinstance(eos, int) else tuple(int(e) for e in eos)
    for key, kind in (("mla_use_nope", bool), ("mla_use_output_gate", bool), ("latent_moe_use_norm", bool),
                      ("use_grouped_topk", bool), ("moe_renormalize", bool), ("tie_word_embeddings", bool),
                      ("rms_norm_eps", float), ("routed_scaling_factor", float)):
        values[key] = kind(values[key])
    for key in ("activation_situ_beta", "activation_situ_linear_beta"):
        if values[key] is not None:
            values[key] = float(values[key])
    values["linear_attn"] = LinearAttnConfig.from_hf_dict(d, d["num_hidden_layers"])
    values["quantization"] = QuantizationConfig.from_hf_dict(d.get("quantization_config") or top.get("quantization_config"))
    values["model_type"] = model_type
    return values, d.get("mlp_layer_types")


def parse_kimi_fields(d: dict[str, Any]) -> Fields:
    """d: a whole config.json of model_type kimi_linear or kimi_k3 -> (KimiLinearConfig's fields, the
    mlp_layer_types to check against them, if given): KimiLinearConfig.from_hf_dict builds and checks."""
    model_type = d.get("model_type")
    if model_type == "kimi_linear":
        return _text_fields(d, "kimi_linear", {})
    if model_type == "kimi_k3":
        text = d.get("text_config")
        if not isinstance(text, dict):
            raise ValueError("text_config must be an object in a kimi_k3 config.json")
        if text.get("model_type", "kimi_linear") != "kimi_linear":
            raise ValueError(f"text_config.model_type must be 'kimi_linear', got {text.get('model_type')!r}")
        return _text_fields(text, "kimi_k3", d)
    raise ValueError(f"model_type must be 'kimi_linear' or 'kimi_k3' for a Kimi config, got {model_type!r}")
