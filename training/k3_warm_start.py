"""Warm start of the K3-shaped target from the repo's DeepSeek-V3-shaped default model (models/pdserve-tiny).

The two models share the tokenizer, the hidden size (192), the MLA geometry (24 heads, q_lora 96, kv_lora 64,
nope / rope / v 16), layer 0's dense MLP width (512) and the shared-expert width (128), so those trained
tensors are copied before training instead of starting from noise: the embedding and LM head, the final
norm, layer 0's MLP and norms, the MLA projections (the "rope" dims are then used unrotated: K3 is NoPE) and
the shared experts. SiLU-GLU weights carry over to SiTU-GLU (SiTU is SiLU-GLU soft-capped at large values).
Everything K3 adds (KDA layers, output gates, Attention Residual weights, the latent routed experts) starts
from its fresh initialisation. A compute saving on a shared 2-core machine, stated in the model card.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors.torch import load_file

from training.k3_layers import GatedMLA, LatentMoE
from training.k3_net import K3Net

logger = logging.getLogger(__name__)

MLA_TENSORS = ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj")


def warm_start_plan(net: K3Net, source_layers: int) -> dict[str, str]:
    """K3Net parameter name -> DeepSeek-V3 checkpoint name, for every tensor copied."""
    plan = {"model.embed_tokens.weight": "model.embed_tokens.weight", "lm_head.weight": "lm_head.weight",
            "model.norm.weight": "model.norm.weight"}
    last = source_layers - 1
    for index, layer in enumerate(net.model.layers):
        src = min(index, last)
        mine, theirs = f"model.layers.{index}.", f"model.layers.{src}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            plan[f"{mine}{norm}.weight"] = f"{theirs}{norm}.weight"
        if isinstance(layer.self_attn, GatedMLA):
            for name in MLA_TENSORS:
                plan[f"{mine}self_attn.{name}.weight"] = f"model.layers.{last}.self_attn.{name}.weight"
        mlp = f"{mine}mlp.shared_experts." if isinstance(layer.mlp, LatentMoE) else f"{mine}mlp."
        source_mlp = f"{theirs}mlp.shared_experts." if isinstance(layer.mlp, LatentMoE) else f"{theirs}mlp."
        for proj in ("gate_proj", "up_proj", "down_proj"):
            plan[f"{mlp}{proj}.weight"] = f"{source_mlp}{proj}.weight"
    return plan


@torch.no_grad()
def warm_start(net: K3Net, source_dir: Path) -> int:
    """Copies the tensors of warm_start_plan from source_dir's checkpoint; returns how many were copied.
    A shape mismatch raises ValueError naming the tensor."""
    config = json.loads((source_dir / "config.json").read_text())
    tensors = load_file(str(source_dir / "model.safetensors"))
    params = dict(net.named_parameters())
    plan = warm_start_plan(net, config["num_hidden_layers"])
    for mine, theirs in plan.items():
        if tensors[theirs].shape != params[mine].shape:
            raise ValueError(f"warm start: {theirs} {tuple(tensors[theirs].shape)} does not fit {mine} "
                             f"{tuple(params[mine].shape)}")
        params[mine].copy_(tensors[theirs].float())
    logger.info("warm start: %d tensors from %s", len(plan), source_dir)
    return len(plan)
