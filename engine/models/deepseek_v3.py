"""DeepSeek-V3 architecture (MLA + MoE) assembled from engine.layers; parameter names follow HF's."""
from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

from engine.attention.base import AttentionBackend
from engine.model_configs.model_config import ModelConfig
from engine.runtime.distributed import TPGroup
from engine.models.causal_lm import CausalLM, DecoderStack, build_and_load, materialize
from engine.runtime.forward_batch import ForwardBatch
from engine.cache.kv_cache import PagedLatentCache
from engine.layers.mla import MLAAttention
from engine.layers.mlp import DenseMLP
from engine.layers.moe import MoE
from engine.layers.norm import RMSNorm
from engine.weights.sharding import owned_elsewhere, shard_weight
from engine.weights.weight_check import WeightCheck
from engine.layers.fp8_conversion import Fp8Loader
from engine.weights.checkpoint import (
    checkpoint_block_size,
    expected_weight_shapes,
    is_mtp_weight,
    iter_checkpoint,
    stored_fp8_names,
)

logger = logging.getLogger(__name__)


class ModelOutput(NamedTuple):
    """hidden: [T, hidden] after the final norm; captured: [T, hidden] residual stream after each requested layer."""

    hidden: torch.Tensor
    captured: tuple[torch.Tensor, ...]


class DecoderLayer(nn.Module):
    """Pre-norm residual block: h += MLA(norm(h)); h += MLP-or-MoE(norm(h))."""

    def __init__(self, config: ModelConfig, index: int, tp: TPGroup, attention: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = MLAAttention(config, index, tp, attention, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        if config.is_moe_layer(index):
            self.mlp: nn.Module = MoE(config, tp, dtype)
        else:
            self.mlp = DenseMLP(config.hidden_size, config.intermediate_size, tp, dtype)

    def forward(self, h: torch.Tensor, batch: ForwardBatch, cache: PagedLatentCache) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), batch, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class DeepseekV3Model(DecoderStack):
    def __init__(self, config: ModelConfig, tp: TPGroup, attention: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__(config, tp, attention, dtype, DecoderLayer)
        for layer in self.layers[1:]:  # one RoPE module: its cos/sin are computed once per step
            layer.self_attn.rotary = self.layers[0].self_attn.rotary


class DeepseekV3ForCausalLM(CausalLM):
    """One tensor-parallel rank of the model. Every rank gets the same batch and returns the same outputs."""

    def __init__(self, config: ModelConfig, tp: TPGroup, attention: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__(config, tp, attention, dtype, DeepseekV3Model)

    def forward(
        self, batch: ForwardBatch, cache: PagedLatentCache, capture_layers: tuple[int, ...] = ()
    ) -> ModelOutput:
        """Runs every layer on batch.input_ids [T]; writes each layer's latents into `cache` at batch.attn.slot_mapping."""
        for layer in capture_layers:
            if not 0 <= layer < self.config.num_hidden_layers:
                raise ValueError(f"capture layer {layer} outside 0..{self.config.num_hidden_layers - 1}")
        wanted = set(capture_layers)
        captured: dict[int, torch.Tensor] = {}
        h = self.embed(batch.input_ids)
        for index, layer in enumerate(self.model.layers):
            h = layer(h, batch, cache)
            if index in wanted:
                captured[index] = h
        return ModelOutput(self.model.norm(h), tuple(captured[i] for i in capture_layers))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], fp8: Fp8Loader | None = None) -> None:
        """Copies this rank's shard of each full checkpoint tensor into place. Raises ONE ValueError naming
        every missing, unexpected or mis-shaped tensor (nothing half-reported). fp8: FP8 weights and their
        scales go to the layers it converted (weights kept FP8 on a GPU)."""
        config = self.config
        check = WeightCheck(expected_weight_shapes(config))
        params = dict(self.named_parameters())
        for name, tensor in weights:
            if is_mtp_weight(name, config.num_hidden_layers) or name.endswith("rotary_emb.inv_freq"):
                continue
            is_fp8_part = name.endswith("_scale_inv") or tuple(tensor.shape) == check.expected.get(name)
            if fp8 is not None and is_fp8_part and fp8.take(name, tensor):
                check.mark_seen(name)
                continue
            shape = check.expect(name, name)
            if shape is None:
                continue
            if tuple(tensor.shape) != shape:
                check.wrong_shape(name, tuple(tensor.shape), shape)
                continue
            piece = shard_weight(name, tensor, self.tp, config.n_routed_experts)
            if piece is not None:
                self._target(params, *piece).copy_(piece[1])
        if fp8 is not None:
            fp8.finish()
        check.raise_if_wrong()
        for layer in self.model.layers:
            layer.self_attn.process_weights_after_loading()
        logger.info("rank %d/%d loaded %d tensors", self.tp.rank, self.tp.size, len(check.seen))

    def _target(self, params: dict[str, nn.Parameter], local_name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The parameter (or slice of the stacked expert parameters) a local weight name is copied into."""
        if ".mlp.experts." not in local_name:
            return params[local_name].data
        prefix, rest = local_name.split(".mlp.experts.")
        expert_str, projection, _ = rest.split(".")
        layer_index = int(prefix.rsplit(".", 1)[1])
        experts = self.model.layers[layer_index].mlp.experts
        expert = int(expert_str)
        inter = experts.intermediate_size
        if projection == "gate_proj":
            return experts.gate_up_proj.data[expert, :inter]
        if projection == "up_proj":
            return experts.gate_up_proj.data[expert, inter:]
        return experts.down_proj.data[expert]


def load_model(
    model_dir: str | Path, tp: TPGroup, attention: AttentionBackend, dtype: torch.dtype,
    device: torch.device | str = "cpu", keep_fp8: bool | None = None,
) -> tuple[ModelConfig, DeepseekV3ForCausalLM]:
    """Reads config.json and the safetensors of model_dir into this rank's model, in eval mode without grads.
    keep_fp8: FP8 checkpoint weights stay FP8 (Fp8Linear / FP8 experts); None: on GPUs only. A model kept FP8
    is built on the meta device, converted there and only then allocated on `device` (at its FP8 size: the
    model-dtype copy, ~163 GB of routed experts per rank for DeepSeek-V3 at TP8 in bf16, never exists), then
    filled tensor by tensor from the checkpoint."""
    config = ModelConfig.from_pretrained(model_dir)

    def skip(name: str) -> bool:
        return owned_elsewhere(name, tp, config.n_routed_experts)

    if keep_fp8 is None:
        keep_fp8 = torch.device(device).type == "cuda"
    fp8_names = stored_fp8_names(model_dir) if keep_fp8 else set()
    if not fp8_names:
        return build_and_load(DeepseekV3ForCausalLM, config, tp, attention, dtype, device,
                              lambda model: model.load_weights(iter_checkpoint(model_dir, config.num_hidden_layers,
                                                                               skip=skip)))
    model, fp8 = _build_fp8_on_meta(model_dir, config, tp, attention, dtype, fp8_names)
    materialize(model, torch.device(device))
    model.load_weights(iter_checkpoint(model_dir, config.num_hidden_layers, skip=skip, keep_fp8=True), fp8)
    model.eval().requires_grad_(False)
    return config, model


def _build_fp8_on_meta(model_dir: str | Path, config: ModelConfig, tp: TPGroup, attention: AttentionBackend,
                       dtype: torch.dtype, fp8_names: set[str]) -> tuple[DeepseekV3ForCausalLM, Fp8Loader]:
    """The rank's model on the meta device (no memory), its FP8 layers already converted."""
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(config, tp, attention, dtype)
        fp8 = Fp8Loader(model, fp8_names, checkpoint_block_size(model_dir), tp, config)
    return model, fp8


def build_empty(model_dir: str | Path, config: ModelConfig, tp: TPGroup, attention: AttentionBackend,
                dtype: torch.dtype, device: torch.device | str = "cpu") -> DeepseekV3ForCausalLM:
    """The rank's model without weights, in the form load_model gives on `device` (FP8 layers converted where
    load_model keeps them FP8, i.e. on a GPU), on the meta device: an importer binds every tensor from the
    owner's export (engine/weights/device_weights.py), whose names then match."""
    fp8_names = stored_fp8_names(model_dir) if torch.device(device).type == "cuda" else set()
    if fp8_names:
        return _build_fp8_on_meta(model_dir, config, tp, attention, dtype, fp8_names)[0]
    with torch.device("meta"):
        return DeepseekV3ForCausalLM(config, tp, attention, dtype)
