"""training/k3_warm_start.py: the K3 target's shared-shape tensors start from the DeepSeek-V3 default model."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from training.k3_net import K3Net
from training.k3_shape import K3Shape
from training.k3_warm_start import warm_start

SOURCE = Path(__file__).resolve().parents[2] / "models" / "pdserve-tiny"


def test_copies_every_planned_tensor_exactly() -> None:
    """Embedding, LM head, layer 0 MLP, MLA projections and shared experts equal the source's tensors;
    KDA layers keep their fresh initialisation."""
    net = K3Net(K3Shape(train_length=128))
    before = net.model.layers[0].self_attn.q_proj.weight.clone()
    assert warm_start(net, SOURCE) == 30
    source = load_file(str(SOURCE / "model.safetensors"))
    params = dict(net.named_parameters())
    assert torch.equal(params["model.embed_tokens.weight"], source["model.embed_tokens.weight"].float())
    assert torch.equal(params["model.layers.3.self_attn.kv_b_proj.weight"], source["model.layers.2.self_attn.kv_b_proj.weight"].float())
    assert torch.equal(params["model.layers.1.mlp.shared_experts.up_proj.weight"],
                       source["model.layers.1.mlp.shared_experts.up_proj.weight"].float())
    assert torch.equal(net.model.layers[0].self_attn.q_proj.weight, before)


def test_shape_mismatch_is_refused() -> None:
    """A target whose shapes differ from the source's is refused with the tensor named."""
    with pytest.raises(ValueError, match="embed_tokens"):
        warm_start(K3Net(K3Shape(hidden_size=128, train_length=128)), SOURCE)
