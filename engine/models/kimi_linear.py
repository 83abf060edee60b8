"""Kimi Linear (transformers' KimiLinearForCausalLM): KDA and NoPE MLA layers per linear_attn_config,
a dense first layer then DeepSeek-style MoE with its sigmoid router, plain pre-norm residuals.

Checkpoint names are Moonshot's (as transformers' save_pretrained writes them): block_sparse_moe,
experts.N.w1 / w2 / w3, q_conv1d / k_conv1d / v_conv1d, f_a_proj, A_log. They are renamed to the
engine's DeepSeek names (mlp, gate_proj / down_proj / up_proj) before sharding.
"""
from __future__ import annotations

import logging
import re
from collections.abc import Iterable

import torch
from torch import nn

from engine.attention.base import AttentionBackend
from engine.runtime.distributed import TPGroup
from engine.models.causal_lm import CausalLM, DecoderStack, checkpoint_loader
from engine.layers.kda import KimiDeltaAttention
from engine.layers.mla import MLAAttention
from engine.layers.mlp import DenseMLP
from engine.layers.moe import MoE
from engine.layers.norm import RMSNorm
from engine.model_configs.kimi_linear import KimiLinearConfig
from engine.models.deepseek_v3 import DecoderLayer, DeepseekV3ForCausalLM
from engine.weights.sharding import owned_elsewhere, shard_weight
from engine.weights.weight_check import WeightCheck
from engine.weights.checkpoint import expected_weight_shapes

logger = logging.getLogger(__name__)

_EXPERT_PROJ = re.compile(r"(.*\.mlp\.experts\.\d+\.)(w1|w2|w3)(\.weight)")
_EXPERT_NAMES = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_KDA_PARAM = re.compile(r"model\.layers\.(\d+)\.self_attn\.(.+)")


def engine_name(name: str) -> str:
    """Moonshot checkpoint name -> the engine's DeepSeek-style name (MoE renames only)."""
    name = name.replace(".block_sparse_moe.", ".mlp.")
    match = _EXPERT_PROJ.fullmatch(name)
    if match is not None:
        prefix, projection, suffix = match.groups()
        name = prefix + _EXPERT_NAMES[projection] + suffix
    return name


class KimiDecoderLayer(DecoderLayer):
    """h += Attn(norm(h)); h += MLP-or-MoE(norm(h)) (DecoderLayer.forward); Attn is KDA or NoPE MLA by the
    config's layer lists."""

    def __init__(self, config: KimiLinearConfig, index: int, tp: TPGroup, attention: AttentionBackend, dtype: torch.dtype) -> None:
        nn.Module.__init__(self)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        if config.is_kda_layer(index):
            self.self_attn: nn.Module = KimiDeltaAttention(config, index, config.kda_index(index), tp, dtype)
        else:
            self.self_attn = MLAAttention(config, config.mla_index(index), tp, attention, dtype, use_rope=False,
                                          output_gate=config.mla_use_output_gate,
                                          latent_norm_eps=config.mla_latent_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        if config.is_moe_layer(index):
            self.mlp: nn.Module = MoE(config, tp, dtype)
        else:
            self.mlp = DenseMLP(config.hidden_size, config.intermediate_size, tp, dtype)


class KimiLinearModel(DecoderStack):
    def __init__(self, config: KimiLinearConfig, tp: TPGroup, attention: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__(config, tp, attention, dtype, KimiDecoderLayer)


class KimiLinearForCausalLM(DeepseekV3ForCausalLM):
    """One tensor-parallel rank; embed / forward / compute_logits as DeepseekV3ForCausalLM.
    forward needs batch.state_slots and cache.state (the KDA layers' per-sequence state)."""

    def __init__(self, config: KimiLinearConfig, tp: TPGroup, attention: AttentionBackend, dtype: torch.dtype) -> None:
        if config.model_type != "kimi_linear":
            raise ValueError(f"KimiLinearForCausalLM needs model_type 'kimi_linear', got {config.model_type!r}")
        CausalLM.__init__(self, config, tp, attention, dtype, KimiLinearModel,
                          uses_attention=bool(config.num_mla_layers))

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the checkpoint must hold (engine names), full shapes."""
        shapes = expected_weight_shapes(self.config)
        for index in self.config.kda_layer_ids:
            prefix = f"model.layers.{index}.self_attn."
            shapes = {name: shape for name, shape in shapes.items() if not name.startswith(prefix)}
            kda = self.model.layers[index].self_attn
            shapes.update({prefix + local: shape for local, shape in kda.expected_shapes().items()})
        return shapes

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies this rank's shard of each checkpoint tensor; ONE ValueError names every missing,
        unexpected or mis-shaped tensor (a checkpoint whose layer kinds disagree with the config shows
        up as missing KDA / MLA tensors of those layers)."""
        check = WeightCheck(self.expected_shapes())
        params = dict(self.named_parameters())
        for disk_name, tensor in weights:
            name = engine_name(disk_name)
            shape = check.expect(name, disk_name)
            if shape is None:
                continue
            kda_match = _KDA_PARAM.fullmatch(name)
            layer = self.model.layers[int(kda_match.group(1))] if kda_match else None
            if layer is not None and isinstance(layer.self_attn, KimiDeltaAttention):
                if not layer.self_attn.accepts_shape(kda_match.group(2), tuple(tensor.shape)):
                    check.wrong_shape(disk_name, tuple(tensor.shape), shape)
                else:
                    layer.self_attn.load_weight(kda_match.group(2), tensor)
                continue
            if tuple(tensor.shape) != shape:
                check.wrong_shape(disk_name, tuple(tensor.shape), shape)
                continue
            piece = shard_weight(name, tensor, self.tp, self.config.num_experts)
            if piece is not None:
                self._target(params, *piece).copy_(piece[1])
        check.raise_if_wrong()
        for layer in self.model.layers:
            if isinstance(layer.self_attn, MLAAttention):
                layer.self_attn.process_weights_after_loading()
        logger.info("rank %d/%d loaded %d tensors", self.tp.rank, self.tp.size, len(check.seen))


def _expert_elsewhere(stored_name: str, tp: TPGroup, num_experts: int) -> bool:
    return owned_elsewhere(engine_name(stored_name), tp, num_experts)


load_model = checkpoint_loader(KimiLinearForCausalLM, KimiLinearConfig, _expert_elsewhere, drop_mtp=True)
