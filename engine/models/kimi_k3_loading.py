"""Loading a Kimi K3 checkpoint into one tensor-parallel rank of KimiK3ForCausalLM.

Each tensor is checked against the config's expected name / shape / dtype (engine/models/kimi_k3_weights.py),
then sharded by the module that owns it: column-parallel linears, the embedding and the LM head by rows,
row-parallel linears by columns, replicated modules whole; KDA layers slice their own tensors
(KimiDeltaAttention.load_weight); MXFP4 experts are copied packed into the owning rank's PackedExperts, unquantised ones (no
quantization_config) into its DenseExperts; an expert tensor of the other format is refused by name.
Every problem is collected and raised as ONE ValueError naming the on-disk tensors.
"""
from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from engine.runtime.distributed import TPGroup
from engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from engine.layers.linear import ColumnParallelLinear, RowParallelLinear
from engine.models.kimi_k3_weights import engine_name, expected_k3_tensors
from engine.weights.weight_check import WeightCheck

_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(w[123])\.weight(?:_(packed|scale))?")
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.*)")


def expert_owned_elsewhere(disk_name: str, tp: TPGroup, num_experts: int) -> bool:
    """True for a routed-expert tensor another rank owns (and for ignored tensors): not worth reading."""
    name = engine_name(disk_name)
    if name is None:
        return True
    match = _EXPERT.fullmatch(name)
    if match is None or tp.size == 1:
        return False
    start, end = tp.shard_range(num_experts)
    return not start <= int(match.group(2)) < end


def disk_name(name: str, model: Any) -> str:
    """The on-disk spelling of an engine name (for error messages)."""
    match = _LAYER.fullmatch(name)
    if match and model.config.is_moe_layer(int(match.group(1))):
        name = name.replace(".mlp.", ".block_sparse_moe.", 1)
    return "language_model." + name


def shard_for_module(module: nn.Module, tensor: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """This rank's piece of a full tensor, by the kind of module that owns it."""
    if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding, ParallelLMHead)):
        dim = 0
    elif isinstance(module, RowParallelLinear):
        dim = 1
    else:
        return tensor
    start, end = tp.shard_range(tensor.shape[dim])
    return tensor.narrow(dim, start, end - start)


def _kda_tensor(model: Any, name: str) -> tuple[Any, str] | None:
    """(the KDA module, its local name) when `name` is a KDA layer's tensor."""
    match = _LAYER.fullmatch(name)
    if match is None or not match.group(2).startswith("self_attn."):
        return None
    layer = model.model.layers[int(match.group(1))]
    return (layer.self_attn, match.group(2)[len("self_attn."):]) if layer.is_kda else None


def _shape_ok(model: Any, name: str, shape: tuple[int, ...], expected: tuple[int, ...]) -> bool:
    """Exact shape, except where a KDA layer accepts other stored layouts (A_log zero-padded to [128])."""
    kda = _kda_tensor(model, name)
    return kda[0].accepts_shape(kda[1], shape) if kda is not None else shape == expected


def _copy(model: Any, params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor) -> None:
    layers = model.model.layers
    expert = _EXPERT.fullmatch(name)
    if expert is not None:
        layer, index, projection, part = expert.groups()
        moe = layers[int(layer)].mlp
        moe.experts.target(int(index) - moe.expert_start, projection, part or "weight").copy_(tensor)
        return
    kda = _kda_tensor(model, name)
    if kda is not None:
        kda[0].load_weight(kda[1], tensor)
        return
    owner = model.get_submodule(name.rsplit(".", 1)[0])
    params[name].data.copy_(shard_for_module(owner, tensor, model.tp))


def _other_expert_format(config: Any, name: str, stored_name: str) -> str | None:
    """Why a routed-expert tensor of the other format (MXFP4 vs unquantised) than the config's cannot load: a
    half-quantised checkpoint is refused naming the tensor; None for any other tensor."""
    match = _EXPERT.fullmatch(name)
    if match is None or (match.group(4) is not None) == (config.quantization is not None):
        return None
    if config.quantization is not None:
        return (f"{stored_name} is unquantised, but quantization_config says the routed experts are MXFP4 "
                "(a half-quantised checkpoint: every expert must be MXFP4 weight_packed + weight_scale)")
    return (f"{stored_name} is MXFP4, but config.json has no quantization_config (a half-quantised checkpoint: "
            "every expert must be an unquantised .weight, or the config must declare MXFP4)")


def load_k3_weights(model: Any, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Copies every tensor of `weights` (on-disk names, full shapes; 'meta' for experts other ranks own) into
    `model`; returns how many were checked. Raises one ValueError for every missing / unexpected /
    mis-shaped (or wrongly typed MXFP4) tensor."""
    layers = model.model.layers
    check = WeightCheck(expected_k3_tensors(model.config, lambda i: layers[i].self_attn.expected_shapes()))
    params = dict(model.named_parameters())
    for stored_name, tensor in weights:
        name = engine_name(stored_name)
        if name is None:
            continue
        mixed = _other_expert_format(model.config, name, stored_name)
        if mixed is not None:
            check.misshaped.append(mixed)
            continue
        spec = check.expect(name, stored_name)
        if spec is None:
            continue
        shape, dtype = spec
        if not _shape_ok(model, name, tuple(tensor.shape), shape):
            check.wrong_shape(stored_name, tuple(tensor.shape), shape)
            continue
        if tensor.device.type == "meta":
            continue  # an expert another rank owns
        if dtype is not None and tensor.dtype != dtype:
            check.misshaped.append(f"{stored_name} dtype {tensor.dtype} (expected {dtype})")
            continue
        if dtype is None and not tensor.is_floating_point():
            check.misshaped.append(f"{stored_name} dtype {tensor.dtype} (expected a float dtype)")
            continue
        _copy(model, params, name, tensor)
    check.raise_if_wrong("Kimi K3 ", lambda name: disk_name(name, model))
    return len(check.seen)
