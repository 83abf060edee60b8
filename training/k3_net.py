"""The trainable K3-shaped model: layers of training/k3_layers.py joined by Attention Residuals (K3_SPEC 3.1).

forward(ids [B, T]) -> final hidden [B, T, hidden] (after the output Agg and norm) and, for capture_layers,
the taps a DSpark draft reads: after layer i, the stream value its next consumer mixes, before that
consumer's norm (engine/models/kimi_k3.py computes the same).
"""
from __future__ import annotations

import torch
from torch import nn

from training.k3_layers import KDA, GatedMLA, LatentMoE, RMSNorm, SiTUMLP, linear
from training.k3_shape import K3Shape


def attn_res_mix(bank: list[torch.Tensor], partial: torch.Tensor, proj: nn.Linear, norm: RMSNorm) -> torch.Tensor:
    """Agg: softmax over rows (bank + [P]) of proj(RMSNorm(row)), mixing the raw rows. Rows [B, T, hidden]."""
    if not bank:
        return partial
    rows = torch.stack([*bank, partial], dim=-2)  # [B, T, R, hidden]
    weights = torch.softmax((norm(rows) * proj.weight.view(-1)).sum(-1), dim=-1)
    return (weights.unsqueeze(-1) * rows).sum(dim=-2)


class K3Layer(nn.Module):
    def __init__(self, s: K3Shape, index: int) -> None:
        super().__init__()
        self.closes_block = index % s.attn_res_block_size == 0
        for name in ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm", "mlp_res_norm"):
            setattr(self, name, RMSNorm(s.hidden_size, s.rms_norm_eps))
        self.self_attention_res_proj, self.mlp_res_proj = linear(s.hidden_size, 1), linear(s.hidden_size, 1)
        for proj in (self.self_attention_res_proj, self.mlp_res_proj):
            nn.init.zeros_(proj.weight)  # uniform mixing at the start
        self.self_attn: nn.Module = GatedMLA(s) if s.is_mla(index) else KDA(s)
        self.mlp: nn.Module = SiTUMLP(s.hidden_size, s.intermediate_size) if index == 0 else LatentMoE(s)

    def forward(self, bank: list[torch.Tensor], partial: torch.Tensor) -> torch.Tensor:
        """Runs the layer; appends to `bank` when it closes a block; returns the new partial sum."""
        x_a = self.input_layernorm(attn_res_mix(bank, partial, self.self_attention_res_proj, self.self_attention_res_norm))
        if self.closes_block:
            bank.append(partial)
            partial = torch.zeros_like(partial)
        partial = partial + self.self_attn(x_a)
        x_m = self.post_attention_layernorm(attn_res_mix(bank, partial, self.mlp_res_proj, self.mlp_res_norm))
        return partial + self.mlp(x_m)


class K3Inner(nn.Module):
    def __init__(self, s: K3Shape) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(s.vocab_size, s.hidden_size)
        self.layers = nn.ModuleList(K3Layer(s, i) for i in range(s.num_hidden_layers))
        self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.output_attn_res_norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.output_attn_res_proj = linear(s.hidden_size, 1)
        nn.init.zeros_(self.output_attn_res_proj.weight)


class K3Net(nn.Module):
    """Parameter names are the engine's (the checkpoint's without 'language_model.'), except the routed
    experts, held stacked as mlp.w1 / w3 [E, I, latent] and mlp.w2 [E, latent, I] (training/k3_export.py)."""

    def __init__(self, shape: K3Shape) -> None:
        super().__init__()
        self.shape = shape
        self.model = K3Inner(shape)
        self.lm_head = linear(shape.hidden_size, shape.vocab_size)
        for name, param in self.named_parameters():
            if param.ndim == 2 and "res_proj" not in name and "gate.weight" not in name:
                nn.init.normal_(param, std=0.02)
        layers = self.model.layers
        for layer in layers:  # output projections scaled down by depth
            for proj in (layer.self_attn.o_proj, layer.mlp.shared_experts.down_proj if isinstance(layer.mlp, LatentMoE)
                         else layer.mlp.down_proj):
                nn.init.normal_(proj.weight, std=0.02 / (2 * len(layers)) ** 0.5)

    def forward(self, ids: torch.Tensor, capture_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
        inner = self.model
        bank: list[torch.Tensor] = []
        partial = inner.embed_tokens(ids)
        taps = {}
        for index, layer in enumerate(inner.layers):
            partial = layer(bank, partial)
            if index in capture_layers:
                if index + 1 < len(inner.layers):
                    nxt = inner.layers[index + 1]
                    taps[index] = attn_res_mix(bank, partial, nxt.self_attention_res_proj, nxt.self_attention_res_norm)
                else:
                    taps[index] = attn_res_mix(bank, partial, inner.output_attn_res_proj, inner.output_attn_res_norm)
        hidden = inner.norm(attn_res_mix(bank, partial, inner.output_attn_res_proj, inner.output_attn_res_norm))
        return hidden, [taps[i] for i in capture_layers]

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self(ids)[0])

    def moe_layers(self) -> list[LatentMoE]:
        return [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, LatentMoE)]
