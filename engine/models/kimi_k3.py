"""Kimi K3 (model_type "kimi_k3") assembled from engine.layers: KDA and gated NoPE MLA layers, Attention
Residuals instead of residual adds, a dense SiTU layer 0 and LatentMoE layers with MXFP4 routed experts (or unquantised ones: a checkpoint without
quantization_config).

The paged latent cache holds the MLA layers only (MLA layer i writes its ordinal config.mla_index(i));
KDA layers keep their per-sequence conv and recurrent state in cache.state at batch.state_slots.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn

from engine.attention.base import AttentionBackend
from engine.runtime.distributed import TPGroup
from engine.models.causal_lm import CausalLM, DecoderStack, checkpoint_loader
from engine.runtime.forward_batch import ForwardBatch
from engine.cache.kv_cache import PagedLatentCache
from engine.layers.attn_res import ResidualStream, is_block_start
from engine.layers.latent_moe import LatentMoE, LatentMoEShape
from engine.layers.linear import ReplicatedLinear
from engine.layers.mla import MLAAttention
from engine.layers.norm import RMSNorm
from engine.layers.situ import SiTUMLP
from engine.model_configs.kimi_linear import KimiLinearConfig
from engine.models.deepseek_v3 import ModelOutput
from engine.models.kimi_k3_loading import expert_owned_elsewhere, load_k3_weights

logger = logging.getLogger(__name__)


def latent_moe_shape(c: KimiLinearConfig) -> LatentMoEShape:
    """The LatentMoE geometry of a K3 config."""
    if c.routed_expert_hidden_size is None:
        raise ValueError("kimi_k3 needs routed_expert_hidden_size (the LatentMoE width)")
    if c.quantization is not None and not c.quantization.is_mxfp4:
        raise ValueError("kimi_k3 routed experts must be MXFP4 (quantization_config format mxfp4-pack-quantized) "
                         "or unquantised (no quantization_config)")
    return LatentMoEShape(
        hidden_size=c.hidden_size, latent_size=c.routed_expert_hidden_size, intermediate_size=c.moe_intermediate_size,
        num_experts=c.num_experts, top_k=c.num_experts_per_token, shared_intermediate_size=c.shared_intermediate_size,
        use_norm=c.latent_moe_use_norm, renormalize=c.moe_renormalize, routed_scaling_factor=c.routed_scaling_factor,
        situ_beta=c.activation_situ_beta, situ_linear_beta=c.activation_situ_linear_beta, rms_norm_eps=c.rms_norm_eps,
        mxfp4_experts=c.quantization is not None,
    )


class K3DecoderLayer(nn.Module):
    """One layer: x_a = norm(Agg); [close block]; P += Attn(x_a); x_m = norm(Agg); P += MLP(x_m)."""

    def __init__(self, c: KimiLinearConfig, index: int, tp: TPGroup, attention: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        self.index = index
        self.closes_block = is_block_start(index, c.attn_res_block_size)
        hidden, eps = c.hidden_size, c.rms_norm_eps
        for name in ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm", "mlp_res_norm"):
            setattr(self, name, RMSNorm(hidden, eps, dtype))
        self.self_attention_res_proj = ReplicatedLinear(hidden, 1, dtype)
        self.mlp_res_proj = ReplicatedLinear(hidden, 1, dtype)
        self.is_kda = c.is_kda_layer(index)
        if self.is_kda:
            from engine.layers.kda import KimiDeltaAttention

            self.self_attn: nn.Module = KimiDeltaAttention(c, index, c.kda_index(index), tp, dtype)
        else:
            self.self_attn = MLAAttention(c, c.mla_index(index), tp, attention, dtype, use_rope=not c.mla_use_nope,
                                          output_gate=c.mla_use_output_gate, latent_norm_eps=c.mla_latent_norm_eps)
        if c.is_moe_layer(index):
            self.mlp: nn.Module = LatentMoE(latent_moe_shape(c), tp, dtype)
        else:
            self.mlp = SiTUMLP(hidden, c.intermediate_size, tp, dtype, c.activation_situ_beta, c.activation_situ_linear_beta)

    def forward(self, stream: ResidualStream, batch: ForwardBatch, cache: PagedLatentCache,
                attention_mix: torch.Tensor | None = None) -> None:
        """attention_mix: this layer's attention-side Agg when the caller already computed it from this stream
        (a captured tap is exactly that value), else computed here."""
        if attention_mix is None:
            attention_mix = stream.mix(self.self_attention_res_proj.weight, self.self_attention_res_norm)
        x_a = self.input_layernorm(attention_mix)
        if self.closes_block:
            stream.close_block()
        stream.add(self.self_attn(x_a, batch, cache))
        x_m = self.post_attention_layernorm(stream.mix(self.mlp_res_proj.weight, self.mlp_res_norm))
        stream.add(self.mlp(x_m))


class KimiK3Model(DecoderStack):
    def __init__(self, c: KimiLinearConfig, tp: TPGroup, attention: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__(c, tp, attention, dtype, K3DecoderLayer)
        self.output_attn_res_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.output_attn_res_proj = ReplicatedLinear(c.hidden_size, 1, dtype)


class KimiK3ForCausalLM(CausalLM):
    """One tensor-parallel rank of Kimi K3 (text decoder). Every rank gets the same batch and returns the same outputs."""

    def __init__(self, config: KimiLinearConfig, tp: TPGroup, attention: AttentionBackend, dtype: torch.dtype) -> None:
        if config.model_type != "kimi_k3":
            raise ValueError(f"KimiK3ForCausalLM needs model_type 'kimi_k3', got {config.model_type!r}")
        if config.attn_res_block_size is None:
            raise ValueError("kimi_k3 needs attn_res_block_size (Attention Residuals)")
        super().__init__(config, tp, attention, dtype, KimiK3Model, uses_attention=bool(config.num_mla_layers))

    def forward(
        self, batch: ForwardBatch, cache: PagedLatentCache, capture_layers: tuple[int, ...] = ()
    ) -> ModelOutput:
        """Runs every layer on batch.input_ids [T]. captured[j]: after layer capture_layers[j], the stream
        value its next consumer mixes, before that consumer's norm (layer i+1's attention-side Agg, or the
        output-side Agg after the last layer)."""
        layers = self.model.layers
        for index in capture_layers:
            if not 0 <= index < len(layers):
                raise ValueError(f"capture layer {index} outside 0..{len(layers) - 1}")
        captured: dict[int, torch.Tensor] = {}
        stream = ResidualStream(self.embed(batch.input_ids))
        mix = None  # a tap is the next consumer's Agg: that consumer takes it instead of mixing the stream again
        for index, layer in enumerate(layers):
            layer(stream, batch, cache, mix)
            mix = self._next_mix(stream, index) if index in capture_layers else None
            if mix is not None:
                captured[index] = mix
        if mix is None:
            mix = stream.mix(self.model.output_attn_res_proj.weight, self.model.output_attn_res_norm)
        return ModelOutput(self.model.norm(mix), tuple(captured[i] for i in capture_layers))

    def _next_mix(self, stream: ResidualStream, index: int) -> torch.Tensor:
        layers = self.model.layers
        if index + 1 < len(layers):
            nxt = layers[index + 1]
            return stream.mix(nxt.self_attention_res_proj.weight, nxt.self_attention_res_norm)
        return stream.mix(self.model.output_attn_res_proj.weight, self.model.output_attn_res_norm)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies this rank's shard of each on-disk tensor into place; ONE ValueError naming every missing,
        unexpected or mis-shaped tensor."""
        count = load_k3_weights(self, weights)
        for layer in self.model.layers:
            if not layer.is_kda:
                layer.self_attn.process_weights_after_loading()
        logger.info("rank %d/%d loaded %d K3 tensors", self.tp.rank, self.tp.size, count)


load_model = checkpoint_loader(KimiK3ForCausalLM, KimiLinearConfig, expert_owned_elsewhere, drop_mtp=False)
