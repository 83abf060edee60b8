"""training/k3_export.py: a trained K3Net saved in K3's layout is the same function in the serving engine."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine import LLM
from engine.layers.mxfp4 import dequantize_mxfp4
from training.k3_export import load_k3, save_k3
from training.k3_net import K3Net
from training.k3_shape import K3Shape, k3_config_dict

SHAPE = K3Shape(vocab_size=256, hidden_size=64, num_hidden_layers=4, num_heads=4, kda_head_dim=8, q_lora_rank=32,
                kv_lora_rank=32, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, intermediate_size=96,
                moe_intermediate_size=32, routed_expert_hidden_size=32, train_length=32)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[K3Net, Path]:
    torch.manual_seed(0)
    net = K3Net(SHAPE)
    with torch.no_grad():  # move the zero-initialised AttnRes projections off their uniform start
        for name, param in net.named_parameters():
            if "res_proj" in name:
                param.normal_(std=0.3)
    out = tmp_path_factory.mktemp("k3net")
    save_k3(net, out, k3_config_dict(SHAPE, 0, 1, 2), dtype=torch.float32)
    return net.eval(), out


def test_engine_logits_equal_the_training_model(saved) -> None:
    """engine LLM(saved).logits == K3Net logits (float32 checkpoint, experts MXFP4 in both)."""
    net, out = saved
    ids = torch.randint(0, SHAPE.vocab_size, (40,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = net.logits(ids[None])[0]
    with LLM(str(out), device="cpu", draft_model="", num_threads=1) as llm:
        got = llm.logits(ids.tolist())
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_round_trip_and_mxfp4_experts(saved) -> None:
    """load_k3 gives back the same function; routed experts are stored packed (uint8) and decode to the
    weights the training forward used (its fake quantiser's rounding)."""
    net, out = saved
    tensors = load_file(str(out / "model.safetensors"))
    packed = tensors["language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_packed"]
    scale = tensors["language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_scale"]
    assert packed.dtype == torch.uint8 and scale.dtype == torch.uint8
    from training.k3_layers import fake_mxfp4

    torch.testing.assert_close(dequantize_mxfp4(packed, scale), fake_mxfp4(net.model.layers[1].mlp.w1.detach())[0])
    assert tensors["language_model.model.layers.0.self_attn.A_log"].shape == (32,)
    ids = torch.randint(0, SHAPE.vocab_size, (2, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(load_k3(SHAPE, out).logits(ids), net.logits(ids), atol=1e-5, rtol=1e-5)
