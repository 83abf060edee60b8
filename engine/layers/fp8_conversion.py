"""Keeping an FP8 checkpoint FP8 on the GPU: swaps the model's linear layers whose checkpoint weight is FP8
for engine.layers.fp8_linear.Fp8Linear (same tensor-parallel form), switches the routed experts to FP8
storage, and loads each FP8 weight with its weight_scale_inv straight into them during load_weights.

kv_b_proj stays in the model dtype (dequantised here on load): MLA's absorbed decode splits its weight
into per-head matrices after loading. Embeddings, norms and the router are never FP8 in DeepSeek-V3
checkpoints. On CPU the engine does not use this (weights are dequantised on load by engine.weights.checkpoint).
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from engine.model_configs.model_config import ModelConfig
from engine.runtime.distributed import TPGroup
from engine.kernels.fp8_quant import dequantize_fp8_block
from engine.layers.fp8_linear import Fp8Linear
from engine.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from engine.weights.sharding import shard_weight

logger = logging.getLogger(__name__)

DEQUANTISED_ON_LOAD = ("self_attn.kv_b_proj.weight",)
_PARALLEL = {ReplicatedLinear: "replicated", ColumnParallelLinear: "column", RowParallelLinear: "row"}
_SCALE = "_scale_inv"


class Fp8Loader:
    """Built on a freshly constructed model: converts the layers of the FP8 `names`, then take() consumes
    the FP8 weights and scales of iter_checkpoint(keep_fp8=True) in load_weights."""

    def __init__(self, model: nn.Module, names: set[str], block: tuple[int, int], tp: TPGroup,
                 config: ModelConfig) -> None:
        self.model, self.block, self.tp, self.config = model, block, tp, config
        self.pending: dict[str, torch.Tensor] = {}
        converted = 0
        for name in sorted(names):
            module_name = name.removesuffix(".weight")
            if ".mlp.experts." in name or name.endswith(DEQUANTISED_ON_LOAD):
                continue
            linear = model.get_submodule(module_name)
            parallel = _PARALLEL.get(type(linear))
            if parallel is None:
                raise ValueError(f"FP8 weight {name} belongs to a {type(linear).__name__}, which has no FP8 form")
            reduce = getattr(linear, "reduce", True)
            full_in = linear.in_features * (tp.size if parallel == "row" else 1)
            full_out = linear.out_features * (tp.size if parallel == "column" else 1)
            fp8 = Fp8Linear(full_in, full_out, tp, parallel, block, reduce=reduce).to(linear.weight.device)
            parent, _, child = module_name.rpartition(".")
            setattr(model.get_submodule(parent), child, fp8)
            converted += 1
        for layer in {n.split(".mlp.experts.")[0] for n in names if ".mlp.experts." in n}:
            model.get_submodule(layer + ".mlp.experts").keep_fp8(block)
        logger.info("FP8 kept on the device: %d linear layers converted, block %s", converted, block)

    def take(self, name: str, tensor: torch.Tensor) -> bool:
        """Consumes an FP8 weight (held until its scale arrives) or a scale; False for anything else."""
        if name.endswith(_SCALE):
            weight_name = name.removesuffix(_SCALE)
            if weight_name not in self.pending:
                raise ValueError(f"{name} arrived without its FP8 weight")
            self._load(weight_name, self.pending.pop(weight_name), tensor)
            return True
        if tensor.dtype == torch.float8_e4m3fn and not tensor.is_meta:
            self.pending[name] = tensor
            return True
        return False

    def _load(self, name: str, weight: torch.Tensor, scale_inv: torch.Tensor) -> None:
        if ".mlp.experts." in name:
            self._load_expert(name, weight, scale_inv)
        elif name.endswith(DEQUANTISED_ON_LOAD):
            local_name, piece = shard_weight(name, dequantize_fp8_block(weight, scale_inv, self.block),
                                             self.tp, self.config.n_routed_experts)
            self.model.get_parameter(local_name).data.copy_(piece)
        else:
            self.model.get_submodule(name.removesuffix(".weight")).load_full(weight, scale_inv)

    def _load_expert(self, name: str, weight: torch.Tensor, scale_inv: torch.Tensor) -> None:
        layer, rest = name.split(".mlp.experts.")
        expert_str, projection, _ = rest.split(".")
        experts = self.model.get_submodule(layer + ".mlp.experts")
        expert = int(expert_str) - experts.expert_start
        inter, rows = experts.intermediate_size, experts.intermediate_size // self.block[0]
        if projection == "down_proj":
            targets = (experts.down_proj.data[expert], experts.down_scale_inv.data[expert])
        else:
            half = slice(0, inter) if projection == "gate_proj" else slice(inter, 2 * inter)
            scale_half = slice(0, rows) if projection == "gate_proj" else slice(rows, 2 * rows)
            targets = (experts.gate_up_proj.data[expert, half], experts.gate_up_scale_inv.data[expert, scale_half])
        for target, source in zip(targets, (weight, scale_inv)):
            if target.shape != source.shape:
                raise ValueError(f"FP8 expert tensor for {name}: {tuple(source.shape)} does not fit {tuple(target.shape)}")
            target.copy_(source)

    def finish(self) -> None:
        if self.pending:
            raise ValueError("FP8 weights without weight_scale_inv: " + ", ".join(sorted(self.pending)))
