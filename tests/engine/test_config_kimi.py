"""Kimi Linear / Kimi K3 config parsing, layer kinds, state geometry and the model_type registry."""
from __future__ import annotations

import copy
import json

import pytest
import torch

from engine.model_configs.model_config import ModelConfig
from engine.model_configs.kimi_linear import KimiLinearConfig
from engine.models import registry


def k3_config_dict() -> dict:
    """The published Kimi K3 config.json (decoder part as in K3_SPEC section 1)."""
    full = list(range(4, 93, 4)) + [93]
    text = {
        "model_type": "kimi_linear", "vocab_size": 163840, "hidden_size": 7168, "num_hidden_layers": 93,
        "num_attention_heads": 96, "num_key_value_heads": 96, "q_lora_rank": 1536, "kv_lora_rank": 512,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "mla_use_nope": True,
        "mla_use_output_gate": True, "max_position_embeddings": 1048576, "rms_norm_eps": 1e-5,
        "hidden_act": "situ", "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
        "intermediate_size": 33792, "first_k_dense_replace": 1, "moe_layer_freq": 1, "num_experts": 896,
        "num_experts_per_token": 16, "num_shared_experts": 2, "moe_intermediate_size": 3072,
        "routed_expert_hidden_size": 3584, "latent_moe_use_norm": True, "moe_router_activation_func": "sigmoid",
        "topk_method": "noaux_tc", "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1,
        "moe_renormalize": True, "routed_scaling_factor": 1.0, "attn_res_block_size": 12,
        "num_nextn_predict_layers": 0,
        "linear_attn_config": {
            "kda_layers": [i for i in range(1, 94) if i not in full], "full_attn_layers": full, "num_heads": 96,
            "head_dim": 128, "short_conv_kernel_size": 4, "use_full_rank_gate": True, "gate_lower_bound": -5.0,
        },
        "quantization_config": {
            "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
            "config_groups": {"group_0": {"weights": {"num_bits": 4, "group_size": 32}, "targets": ["Linear"]}},
            "ignore": ["re:.*shared_experts.*", "lm_head"],
        },
    }
    return {"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"], "bos_token_id": 163584,
            "eos_token_id": 163586, "pad_token_id": 163839, "media_placeholder_token_id": 163605,
            "tie_word_embeddings": False, "text_config": text, "vision_config": {"model_type": "moonvit3d"}}


def test_k3_every_field_and_layer_kinds():
    """The K3 config parses to the spec's values; MLA layers are 0-idx 3,7,...,91 and 92; 69 KDA layers."""
    c = KimiLinearConfig.from_hf_dict(k3_config_dict())
    assert c.model_type == "kimi_k3" and c.hidden_size == 7168 and c.num_hidden_layers == 93
    assert (c.num_experts, c.num_experts_per_token, c.num_shared_experts) == (896, 16, 2)
    assert (c.routed_expert_hidden_size, c.latent_moe_use_norm, c.attn_res_block_size) == (3584, True, 12)
    assert (c.activation_situ_beta, c.activation_situ_linear_beta, c.hidden_act) == (4.0, 25.0, "situ")
    assert c.mla_use_nope and c.mla_use_output_gate and c.mla_latent_norm_eps == 1e-5
    assert c.linear_attn.gate_lower_bound == -5.0 and c.linear_attn.use_full_rank_gate
    assert c.mla_layer_ids == tuple(range(3, 92, 4)) + (92,)
    assert c.num_kda_layers == 69 and c.num_mla_layers == 24 and c.num_cache_layers == 24
    assert c.kda_index(0) == 0 and c.kda_index(4) == 3 and c.mla_index(92) == 23
    assert not c.is_moe_layer(0) and all(c.is_moe_layer(i) for i in range(1, 93))
    assert (c.bos_token_id, c.eos_token_id, c.pad_token_id, c.media_placeholder_token_id) == (163584, (163586,), 163839, 163605)
    assert c.quantization is not None and c.quantization.is_mxfp4 and c.quantization.group_size == 32
    assert c.quantization.ignore == ("re:.*shared_experts.*", "lm_head")
    c.validate_tp(8)
    assert c.state_shape(8, 1, torch.bfloat16).bytes_per_slot == 56_171_520


def test_kimi_linear_saved_by_transformers(tmp_path):
    """A config written by transformers' KimiLinearConfig.save_pretrained parses with its layer kinds."""
    from transformers import KimiLinearConfig as HFConfig

    HFConfig(vocab_size=64, hidden_size=32, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=4,
             kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8, intermediate_size=48,
             moe_intermediate_size=16, num_local_experts=4, num_experts_per_tok=2, pad_token_id=0, bos_token_id=1,
             eos_token_id=2, linear_attn_config={"head_dim": 8, "num_heads": 2, "short_conv_kernel_size": 4,
                                                 "kda_layers": [1, 2, 3, 5], "full_attn_layers": [4]},
             ).save_pretrained(tmp_path)
    c = registry.load_config(tmp_path)
    assert isinstance(c, KimiLinearConfig) and c.model_type == "kimi_linear"
    assert c.mla_layer_ids == (3,) and c.kda_layer_ids == (0, 1, 2, 4)
    assert (c.num_experts, c.num_experts_per_token, c.routed_scaling_factor) == (4, 2, 2.446)
    assert c.mla_latent_norm_eps == 1e-6 and c.linear_attn.gate_lower_bound is None
    assert c.max_position_embeddings == 1048576


def _k3_with(**text_changes) -> dict:
    d = copy.deepcopy(k3_config_dict())
    for key, value in text_changes.items():
        if key.startswith("lac_"):
            d["text_config"]["linear_attn_config"][key[4:]] = value
        else:
            d["text_config"][key] = value
    return d


@pytest.mark.parametrize("changes,field", [
    ({"lac_full_attn_layers": list(range(4, 93, 4)) + [93, 1]}, "kda_layers and full_attn_layers"),
    ({"lac_full_attn_layers": list(range(4, 93, 4))}, "unassigned"),
    ({"lac_kda_layers": [0, 1]}, "linear_attn_config.kda_layers"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"activation_situ_beta": None}, "activation_situ_beta"),
    ({"mla_use_nope": False}, "mla_use_nope"),
    ({"num_nextn_predict_layers": 1}, "num_nextn_predict_layers"),
    ({"moe_router_activation_func": "softmax"}, "moe_router_activation_func"),
    ({"num_expert_group": 3}, "num_expert_group=3 does not divide num_experts"),
    ({"topk_group": 2}, "topk_group=2 exceeds num_expert_group"),
    ({"num_experts_per_token": 900}, "num_experts_per_token=900 exceeds num_experts"),
    ({"num_expert_group": 448, "topk_group": 4}, "num_experts_per_token=16 exceeds the experts in topk_group"),
    ({"num_key_value_heads": 8}, "num_key_value_heads"),
    ({"lac_gate_lower_bound": 1.0}, "gate_lower_bound"),
    ({"layer_types": ["linear_attention"] * 93}, "layer_types"),
    ({"mlp_layer_types": ["dense"] * 93}, "mlp_layer_types"),
    ({"quantization_config": {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
                              "config_groups": {"g": {"weights": {"num_bits": 4, "group_size": 16}}}}}, "group_size"),
    ({"quantization_config": {"quant_method": "gptq", "format": "mxfp4-pack-quantized",
                              "config_groups": {"g": {"weights": {"num_bits": 4, "group_size": 32}}}}}, "quant_method"),
])
def test_bad_k3_config_names_field(changes, field):
    """Each unsupported or inconsistent value is a ValueError naming its field."""
    with pytest.raises(ValueError, match=field):
        KimiLinearConfig.from_hf_dict(_k3_with(**changes))


def test_heads_not_divisible_by_tp_names_field():
    """96 KDA / MLA heads do not split over 5 ranks: the error names both head fields."""
    c = KimiLinearConfig.from_hf_dict(k3_config_dict())
    with pytest.raises(ValueError, match="linear_attn_config.num_heads=96") as info:
        c.validate_tp(5)
    assert "num_attention_heads=96" in str(info.value)


def test_k3_features_refused_under_kimi_linear():
    """A flat kimi_linear config using a K3-only feature is refused, naming the feature."""
    d = dict(k3_config_dict()["text_config"])
    d.pop("quantization_config")
    with pytest.raises(ValueError, match="routed_expert_hidden_size"):
        KimiLinearConfig.from_hf_dict(d)


def test_registry_picks_config_class_and_rejects_unknown(tmp_path):
    """The registry maps model_type to its config class and rejects an unknown model_type by name."""
    (tmp_path / "config.json").write_text(json.dumps(k3_config_dict()))
    assert isinstance(registry.load_config(tmp_path), KimiLinearConfig)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="model_type 'llama'"):
        registry.load_config(tmp_path)
    assert registry.entry("deepseek_v3").config_class == ModelConfig.__name__


def test_registry_builds_the_model_class(tmp_path):
    """build_model returns the registered class for the checkpoint's model_type (no weights loaded)."""
    from engine.attention.torch_backend import TorchAttentionBackend
    from engine.runtime.distributed import TPGroup
    from engine.models.kimi_linear import KimiLinearForCausalLM
    from tests.engine.kimi_linear_models import make_kimi_checkpoint

    model_dir = make_kimi_checkpoint(tmp_path, "base")
    config = registry.load_config(model_dir)
    model = registry.build_model(model_dir, config, TPGroup(), TorchAttentionBackend(), torch.float32)
    assert type(model) is KimiLinearForCausalLM and model.config is config
