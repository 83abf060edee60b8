"""training/target_shape.py: the DeepSeek-V3 default model's shape becomes its transformers config."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from training.target_shape import CONFIG_FIELDS, TargetShape, build_config


def test_every_shape_field_reaches_the_config() -> None:
    """Each TargetShape field but train_length is the config's field of that name; yarn's factor is the ratio."""
    shape = TargetShape(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                        num_attention_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=8, qk_rope_head_dim=8,
                        v_head_dim=8, n_routed_experts=4, train_length=64, max_position_embeddings=1024)
    config = build_config(shape, bos_id=0, eos_id=1, pad_id=2)
    assert len(CONFIG_FIELDS) == 13 and "train_length" not in CONFIG_FIELDS
    for name in CONFIG_FIELDS:
        assert getattr(config, name) == getattr(shape, name), name
    assert config.rope_parameters["original_max_position_embeddings"] == 64
    assert config.rope_parameters["factor"] == 16
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (0, 1, 2)


def test_odd_widths_are_refused() -> None:
    """A width that TP=2 cannot split raises a ValueError naming it."""
    with pytest.raises(ValueError, match="hidden_size"):
        TargetShape(hidden_size=65)


def test_default_shape_matches_the_embedded_model() -> None:
    """build_config(TargetShape()) agrees with models/pdserve-tiny/config.json, which it was trained with."""
    saved = json.loads((Path(__file__).resolve().parents[2] / "models" / "pdserve-tiny" / "config.json").read_text())
    config = build_config(TargetShape(), saved["bos_token_id"], saved["eos_token_id"], saved["pad_token_id"]).to_dict()
    for name in (*CONFIG_FIELDS, "rope_parameters", "num_experts_per_tok", "n_shared_experts", "first_k_dense_replace"):
        assert config[name] == saved[name], name
