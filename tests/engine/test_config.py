"""ModelConfig parses transformers v4 and v5 config.json layouts to the same frozen config, derives
the MLA numbers transformers uses, and rejects every unsupported or invalid value by naming its field."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest

from engine.model_configs.model_config import ModelConfig, RopeConfig
from tests.engine.tiny_models import DEEPSEEK_V3_CONFIG

DEEPSEEK_V3 = DEEPSEEK_V3_CONFIG


def _v5(d: dict) -> dict:
    out = dict(d)
    rope = dict(out.pop("rope_scaling"))
    rope["rope_type"] = rope.pop("type")
    rope["rope_theta"] = out.pop("rope_theta")
    out["rope_parameters"] = rope
    return out


def test_v4_and_v5_layouts_parse_identically() -> None:
    """rope_theta + rope_scaling (v4) and rope_parameters (v5) give equal configs."""
    v4 = ModelConfig.from_hf_dict(DEEPSEEK_V3)
    assert v4 == ModelConfig.from_hf_dict(_v5(DEEPSEEK_V3))
    assert v4.rope == RopeConfig(rope_type="yarn", theta=10000.0, factor=40.0, original_max_position_embeddings=4096,
                                 beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)
    assert v4.eos_token_id == (1,)


def test_deepseek_v3_derived_values() -> None:
    """qk_head_dim 192, kv_cache_dim 576, softmax scale with yarn mscale(40, 1)^2, MoE from layer 3."""
    config = ModelConfig.from_hf_dict(DEEPSEEK_V3)
    assert config.qk_head_dim == 192 and config.kv_cache_dim == 576
    mscale = 0.1 * math.log(40) + 1.0
    assert config.softmax_scale == pytest.approx(192 ** -0.5 * mscale * mscale, rel=1e-12)
    assert config.rope.cos_sin_scale == pytest.approx(1.0)
    assert [config.is_moe_layer(i) for i in range(5)] == [False, False, False, True, True]


def test_softmax_scale_matches_transformers_formula() -> None:
    """softmax_scale equals transformers' yarn_apply_mscale for the same rope parameters."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    for mscale_all_dim in (0.0, 0.707, 1.0):
        d = _v5(DEEPSEEK_V3)
        d["rope_parameters"]["mscale_all_dim"] = mscale_all_dim
        config = ModelConfig.from_hf_dict(d)
        assert config.softmax_scale == pytest.approx(yarn_apply_mscale(d["rope_parameters"], 192 ** -0.5), rel=1e-12)


def test_tiny_saved_config_parses(tiny_checkpoint) -> None:
    """A config.json written by transformers 5.24 save_pretrained parses; q_lora_rank null means q_proj."""
    config = ModelConfig.from_pretrained(tiny_checkpoint("no_q_lora"))
    assert config.q_lora_rank is None and config.tie_word_embeddings and not config.rope_interleave
    assert config.rope.rope_type == "default" and config.rope.theta == 5000.0
    assert ModelConfig.from_pretrained(tiny_checkpoint("yarn")).rope.rope_type == "yarn"


def test_eos_list_and_moe_layer_freq() -> None:
    """eos_token_id lists become tuples; moe_layer_freq keeps every other layer dense."""
    config = ModelConfig.from_hf_dict({**DEEPSEEK_V3, "eos_token_id": [1, 7], "first_k_dense_replace": 1,
                                       "moe_layer_freq": 2})
    assert config.eos_token_id == (1, 7)
    assert [config.is_moe_layer(i) for i in range(6)] == [False, False, True, False, True, False]


def test_config_is_frozen() -> None:
    """A built config cannot be mutated."""
    config = ModelConfig.from_hf_dict(DEEPSEEK_V3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.vocab_size = 5  # type: ignore[misc]


@pytest.mark.parametrize("changes, field", [
    ({"topk_method": "group_limited_greedy"}, "topk_method"),
    ({"scoring_func": "tanh"}, "scoring_func"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_type"),
    ({"rope_scaling": {**DEEPSEEK_V3["rope_scaling"], "factor": -1}}, "factor"),
    ({"rope_theta": 0}, "rope_theta"),
    ({"n_group": 3}, "n_group"),
    ({"topk_group": 9}, "topk_group"),
    ({"num_experts_per_tok": 300}, "num_experts_per_tok"),
    ({"vocab_size": 0}, "vocab_size"),
    ({"hidden_size": None}, "hidden_size"),
    ({"q_lora_rank": -4}, "q_lora_rank"),
    ({"qk_rope_head_dim": 63}, "qk_rope_head_dim"),
    ({"rms_norm_eps": 0.0}, "rms_norm_eps"),
    ({"routed_scaling_factor": 0}, "routed_scaling_factor"),
    ({"first_k_dense_replace": -1}, "first_k_dense_replace"),
    ({"moe_layer_freq": 0}, "moe_layer_freq"),
    ({"attention_bias": True}, "attention_bias"),
])
def test_invalid_values_name_their_field(changes: dict, field: str) -> None:
    """Every rejected value raises ValueError whose message names the offending field."""
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_hf_dict({**DEEPSEEK_V3, **changes})


def test_missing_required_field_is_named() -> None:
    """A config.json without kv_lora_rank is rejected naming kv_lora_rank."""
    d = dict(DEEPSEEK_V3)
    del d["kv_lora_rank"]
    with pytest.raises(ValueError, match="kv_lora_rank"):
        ModelConfig.from_hf_dict(d)


def test_validate_tp_lists_every_indivisible_size() -> None:
    """TP=8 fits DeepSeek-V3; TP=7 names heads, vocab, dense and expert sizes in one error."""
    config = ModelConfig.from_hf_dict(DEEPSEEK_V3)
    config.validate_tp(8)
    with pytest.raises(ValueError) as info:
        config.validate_tp(7)
    for name in ("num_attention_heads", "vocab_size", "intermediate_size", "n_routed_experts"):
        assert name in str(info.value)
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        ModelConfig.from_hf_dict({**DEEPSEEK_V3, "moe_intermediate_size": 2050, "n_routed_experts": 256}).validate_tp(4)


def test_from_pretrained_reads_file(tmp_path) -> None:
    """from_pretrained reads model_dir/config.json."""
    (tmp_path / "config.json").write_text(json.dumps(DEEPSEEK_V3))
    assert ModelConfig.from_pretrained(tmp_path) == ModelConfig.from_hf_dict(DEEPSEEK_V3)
