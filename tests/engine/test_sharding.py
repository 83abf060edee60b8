"""The sharding table, without a model: every checkpoint name has exactly one rule, each kind splits
the right dimension, the shards of all ranks reassemble the full tensor, and experts go whole to
exactly one rank."""
from __future__ import annotations

import pytest
import torch

from engine.model_configs.model_config import ModelConfig
from engine.runtime.distributed import TPGroup
from engine.weights.sharding import ShardKind, find_rule, owned_elsewhere, shard_weight
from engine.weights.checkpoint import expected_weight_shapes
from tests.engine.tiny_models import DEEPSEEK_V3_CONFIG as DEEPSEEK_V3

CONFIG = ModelConfig.from_hf_dict(DEEPSEEK_V3)


@pytest.mark.parametrize("overrides", [{}, {"q_lora_rank": None}, {"tie_word_embeddings": True}])
def test_every_checkpoint_name_has_one_rule(overrides: dict) -> None:
    """All names a DeepSeek-V3 checkpoint must hold match exactly one rule (find_rule raises otherwise)."""
    config = ModelConfig.from_hf_dict({**DEEPSEEK_V3, **overrides, "num_hidden_layers": 5})
    kinds = {find_rule(name).kind for name in expected_weight_shapes(config)}
    assert kinds == set(ShardKind)


@pytest.mark.parametrize("name, kind", [
    ("model.embed_tokens.weight", ShardKind.VOCAB),
    ("lm_head.weight", ShardKind.VOCAB),
    ("model.norm.weight", ShardKind.REPLICATED),
    ("model.layers.0.input_layernorm.weight", ShardKind.REPLICATED),
    ("model.layers.3.self_attn.q_a_proj.weight", ShardKind.REPLICATED),
    ("model.layers.3.self_attn.q_a_layernorm.weight", ShardKind.REPLICATED),
    ("model.layers.3.self_attn.kv_a_proj_with_mqa.weight", ShardKind.REPLICATED),
    ("model.layers.3.self_attn.kv_a_layernorm.weight", ShardKind.REPLICATED),
    ("model.layers.3.self_attn.q_b_proj.weight", ShardKind.COLUMN),
    ("model.layers.3.self_attn.q_proj.weight", ShardKind.COLUMN),
    ("model.layers.3.self_attn.kv_b_proj.weight", ShardKind.COLUMN),
    ("model.layers.3.self_attn.o_proj.weight", ShardKind.ROW),
    ("model.layers.0.mlp.gate_proj.weight", ShardKind.COLUMN),
    ("model.layers.0.mlp.up_proj.weight", ShardKind.COLUMN),
    ("model.layers.0.mlp.down_proj.weight", ShardKind.ROW),
    ("model.layers.3.mlp.gate.weight", ShardKind.REPLICATED),
    ("model.layers.3.mlp.gate.e_score_correction_bias", ShardKind.REPLICATED),
    ("model.layers.3.mlp.shared_experts.gate_proj.weight", ShardKind.COLUMN),
    ("model.layers.3.mlp.shared_experts.down_proj.weight", ShardKind.ROW),
    ("model.layers.3.mlp.experts.255.up_proj.weight", ShardKind.EXPERT),
])
def test_rule_kinds(name: str, kind: ShardKind) -> None:
    """Each kind of weight is split the way MLA/MoE tensor parallelism needs."""
    assert find_rule(name).kind == kind


def test_unknown_name_is_rejected() -> None:
    """A name no rule covers raises ValueError naming it."""
    with pytest.raises(ValueError, match="model.layers.0.self_attn.rotary.weight"):
        find_rule("model.layers.0.self_attn.rotary.weight")


@pytest.mark.parametrize("name, dim", [
    ("model.layers.1.self_attn.kv_b_proj.weight", 0),
    ("model.layers.1.self_attn.o_proj.weight", 1),
    ("model.embed_tokens.weight", 0),
    ("model.layers.1.mlp.down_proj.weight", 1),
])
def test_shards_reassemble_full_tensor(name: str, dim: int) -> None:
    """Concatenating the shards of ranks 0..tp-1 along the split dim gives back the full tensor."""
    full = torch.randn(24, 12)
    pieces = [shard_weight(name, full, TPGroup(rank, 4), num_experts=8) for rank in range(4)]
    assert all(local == name for local, _ in pieces)
    assert all(piece.shape[dim] == full.shape[dim] // 4 for _, piece in pieces)
    assert torch.equal(torch.cat([piece for _, piece in pieces], dim=dim), full)


def test_replicated_is_whole_on_every_rank() -> None:
    """Replicated weights (the latent projections) are identical and complete on every rank."""
    full = torch.randn(40, 16)
    for rank in range(2):
        _, piece = shard_weight("model.layers.0.self_attn.kv_a_proj_with_mqa.weight", full, TPGroup(rank, 2), 8)
        assert torch.equal(piece, full)


def test_kv_b_proj_splits_by_whole_heads() -> None:
    """kv_b_proj [H*(nope+v), lora]: rank r gets exactly heads [r*H/tp, (r+1)*H/tp)."""
    heads, per_head, lora = 6, 5, 4
    full = torch.randn(heads * per_head, lora)
    for rank in range(3):
        _, piece = shard_weight("model.layers.0.self_attn.kv_b_proj.weight", full, TPGroup(rank, 3), 8)
        by_head = full.view(heads, per_head, lora)[rank * 2 : rank * 2 + 2]
        assert torch.equal(piece.view(2, per_head, lora), by_head)


def test_experts_go_whole_to_their_owner() -> None:
    """Expert e lives only on rank e // (E/tp), unsplit, renumbered to e - rank*E/tp."""
    full = torch.randn(8, 4)
    for expert in range(8):
        name = f"model.layers.2.mlp.experts.{expert}.down_proj.weight"
        owners = []
        for rank in range(4):
            piece = shard_weight(name, full, TPGroup(rank, 4), num_experts=8)
            if piece is not None:
                owners.append(rank)
                assert piece[0] == f"model.layers.2.mlp.experts.{expert - 2 * rank}.down_proj.weight"
                assert piece[1] is full
        assert owners == [expert // 2]


def test_indivisible_split_names_the_weight() -> None:
    """A dimension that does not split evenly raises ValueError naming the weight."""
    with pytest.raises(ValueError, match="o_proj"):
        shard_weight("model.layers.0.self_attn.o_proj.weight", torch.randn(4, 7), TPGroup(0, 2), 8)


def test_owned_elsewhere_marks_only_foreign_experts() -> None:
    """owned_elsewhere is true exactly for per-expert weights of experts another rank owns."""
    tp = TPGroup(rank=1, size=4)
    assert owned_elsewhere("model.layers.3.mlp.experts.0.gate_proj.weight", tp, 8)
    assert not owned_elsewhere("model.layers.3.mlp.experts.2.gate_proj.weight", tp, 8)
    assert not owned_elsewhere("model.layers.3.mlp.experts.3.down_proj.weight", tp, 8)
    assert owned_elsewhere("model.layers.3.mlp.experts.4.down_proj.weight", tp, 8)
    assert not owned_elsewhere("model.layers.3.mlp.shared_experts.down_proj.weight", tp, 8)
    assert not owned_elsewhere("model.layers.3.mlp.experts.0.gate_proj.weight", TPGroup(), 8)
