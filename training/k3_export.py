"""K3Net <-> a Kimi K3 checkpoint in the published layout (what engine/models/kimi_k3.py loads).

On disk: language_model.model.* / language_model.lm_head.weight, block_sparse_moe for MoE layers, routed
experts as experts.N.w1/w2/w3.weight_packed + weight_scale (MXFP4, uint8), A_log zero-padded to
A_LOG_PADDED entries, KDA conv weights / dt_bias / A_log and the router's correction bias in float32,
everything else in `dtype` (bfloat16 by default, as K3 ships).
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from engine.layers.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from training.k3_net import K3Net
from training.k3_shape import K3Shape

A_LOG_PADDED = 32
FLOAT32_SUFFIXES = ("_conv1d.weight", ".dt_bias", ".A_log", ".e_score_correction_bias")
_STACKED = re.compile(r"model\.layers\.(\d+)\.mlp\.(w[123])")
EXPERT_PARTS = ("w1", "w2", "w3")


def disk_name(name: str, shape: K3Shape) -> str:
    match = re.match(r"model\.layers\.(\d+)\.mlp\.", name)
    if match and int(match.group(1)) >= 1:
        name = name.replace(".mlp.", ".block_sparse_moe.", 1)
    return "language_model." + name


def to_checkpoint(net: K3Net, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, on-disk names; experts MXFP4-quantised (the forward's own rounding)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in net.state_dict().items():
        tensor = tensor.detach().float()
        stacked = _STACKED.fullmatch(name)
        if stacked is not None:
            prefix = disk_name(name, net.shape).rsplit(".", 1)[0]
            for expert in range(tensor.shape[0]):
                packed, scale = quantize_mxfp4(tensor[expert])
                out[f"{prefix}.experts.{expert}.{stacked.group(2)}.weight_packed"] = packed
                out[f"{prefix}.experts.{expert}.{stacked.group(2)}.weight_scale"] = scale
            continue
        if name.endswith(".A_log"):
            padded = torch.zeros(max(A_LOG_PADDED, tensor.numel()))
            padded[: tensor.numel()] = tensor
            tensor = padded
        keep32 = name.endswith(FLOAT32_SUFFIXES)
        out[disk_name(name, net.shape)] = tensor.to(torch.float32 if keep32 else dtype).contiguous()
    return out


def from_checkpoint(shape: K3Shape, tensors: dict[str, torch.Tensor]) -> K3Net:
    """A float32 K3Net holding a saved checkpoint's weights (MXFP4 experts decoded exactly)."""
    net = K3Net(shape)
    state: dict[str, torch.Tensor] = {}
    for name, reference in net.state_dict().items():
        stacked = _STACKED.fullmatch(name)
        prefix = disk_name(name, shape).rsplit(".", 1)[0] if stacked else disk_name(name, shape)
        if stacked is not None:
            part = stacked.group(2)
            state[name] = torch.stack([
                dequantize_mxfp4(tensors[f"{prefix}.experts.{e}.{part}.weight_packed"],
                                 tensors[f"{prefix}.experts.{e}.{part}.weight_scale"])
                for e in range(reference.shape[0])])
        else:
            state[name] = tensors[prefix].float().reshape(-1)[: reference.numel()].view_as(reference)
    net.load_state_dict(state)
    return net.eval()


def save_k3(net: K3Net, out: Path, config: dict[str, Any], dtype: torch.dtype = torch.bfloat16) -> None:
    """config.json + model.safetensors under `out` (written to a temporary name first: a crash never
    leaves a half-written checkpoint)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    partial = out / "model.safetensors.partial"
    save_file(to_checkpoint(net, dtype), str(partial))
    partial.replace(out / "model.safetensors")


def load_k3(shape: K3Shape, model_dir: Path) -> K3Net:
    return from_checkpoint(shape, load_file(str(model_dir / "model.safetensors")))
