"""Kimi K3 checkpoint names: on-disk spellings map to engine names, the vision tower is ignored, and the
expected tensors at K3's real config have K3_SPEC section 2's shapes (MXFP4 experts as packed uint8)."""
from __future__ import annotations

import torch

from engine.model_configs.kimi_linear import KimiLinearConfig
from engine.models.kimi_k3_weights import engine_name, expected_k3_tensors
from pdserve.plan.kimi_k3_config import KIMI_K3_CONFIG


def test_engine_names() -> None:
    """language_model.model.* and language_model.layers.* -> model.*; block_sparse_moe -> mlp; lm_head; vision ignored."""
    assert engine_name("language_model.model.layers.3.block_sparse_moe.experts.7.w1.weight_packed") == \
        "model.layers.3.mlp.experts.7.w1.weight_packed"
    assert engine_name("language_model.layers.0.self_attn.A_log") == "model.layers.0.self_attn.A_log"
    assert engine_name("language_model.lm_head.weight") == "lm_head.weight"
    assert engine_name("vision_tower.encoder.blocks.0.wqkv.weight") is None
    assert engine_name("mm_projector.proj.0.weight") is None


def test_real_k3_shapes() -> None:
    """At K3's config: 896 experts x 6 MXFP4 tensors in each of 92 MoE layers, with the spec's packed shapes;
    MLA layers (0-idx 3, ..., 91, 92) hold the output gate and the 576-wide kv_a projection; layer 0 is dense."""
    config = KimiLinearConfig.from_hf_dict(KIMI_K3_CONFIG)
    expected = expected_k3_tensors(config, lambda layer: {"q_proj.weight": (12288, 7168)})
    p = "model.layers.1.mlp."
    assert expected[p + "experts.0.w1.weight_packed"] == ((3072, 1792), torch.uint8)
    assert expected[p + "experts.895.w3.weight_scale"] == ((3072, 112), torch.uint8)
    assert expected[p + "experts.5.w2.weight_packed"] == ((3584, 1536), torch.uint8)
    assert expected[p + "experts.5.w2.weight_scale"] == ((3584, 96), torch.uint8)
    assert expected[p + "routed_expert_down_proj.weight"][0] == (3584, 7168)
    assert expected[p + "routed_expert_norm.weight"][0] == (3584,)
    assert expected[p + "shared_experts.gate_proj.weight"][0] == (6144, 7168)
    assert expected["model.layers.0.mlp.gate_proj.weight"][0] == (33792, 7168)
    assert sum(1 for name in expected if ".experts." in name) == 92 * 896 * 6
    for layer in (3, 91, 92):
        a = f"model.layers.{layer}.self_attn."
        assert expected[a + "kv_a_proj_with_mqa.weight"][0] == (576, 7168)
        assert expected[a + "q_b_proj.weight"][0] == (18432, 1536)
        assert expected[a + "g_proj.weight"][0] == (12288, 7168)
    assert "model.layers.4.self_attn.q_proj.weight" in expected  # a KDA layer's own tensors
    assert expected["model.output_attn_res_proj.weight"][0] == (1, 7168)
