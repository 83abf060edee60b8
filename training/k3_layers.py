"""Trainable, batched K3 building blocks ([B, T, hidden] in, float32) with the engine's maths and the
checkpoint's parameter names: KDA, gated NoPE MLA, LatentMoE with SiTU and MXFP4 experts (fake-quantised
in every forward with a straight-through estimator, so the saved MXFP4 weights are the trained ones).

The engine (engine/layers/*) is the served path and the reference; tests/training checks that a saved
model's engine logits equal these modules' logits.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.kda_ops import kda_gate, l2_normalize
from engine.layers.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from engine.layers.situ import situ_glu
from training.k3_shape import K3Shape
from training.kda_train import chunk_size_for, kda_chunked_batch

SITU_BETA, SITU_LINEAR_BETA = 4.0, 25.0


def linear(inp: int, out: int) -> nn.Linear:
    return nn.Linear(inp, out, bias=False)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


def fake_mxfp4(weight: torch.Tensor) -> torch.Tensor:
    """weight rounded to MXFP4 in the forward, identity in the backward (straight-through estimator)."""
    with torch.no_grad():
        rounded = dequantize_mxfp4(*quantize_mxfp4(weight))
    return weight + (rounded - weight).detach()


class SiTUMLP(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = linear(hidden, inter), linear(hidden, inter), linear(inter, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(situ_glu(self.gate_proj(x), self.up_proj(x), SITU_BETA, SITU_LINEAR_BETA))


class KDA(nn.Module):
    """Kimi Delta Attention (K3_SPEC 3.2) over whole sequences from a zero state."""

    def __init__(self, s: K3Shape) -> None:
        super().__init__()
        hidden, proj, dim = s.hidden_size, s.kda_proj, s.kda_head_dim
        self.heads, self.dim, self.width, self.eps, self.lower_bound = s.num_heads, dim, s.conv_width, s.rms_norm_eps, s.gate_lower_bound
        self.chunk = chunk_size_for(s.gate_lower_bound)
        for name in ("q", "k", "v"):
            setattr(self, f"{name}_proj", linear(hidden, proj))
            conv = nn.Module()
            init = torch.randn(proj, 1, s.conv_width) * 0.1
            init[:, 0, -1] += 1.0  # start near the identity (the current input)
            conv.weight = nn.Parameter(init)
            setattr(self, f"{name}_conv1d", conv)
        self.f_a_proj, self.f_b_proj = linear(hidden, dim), linear(dim, proj)
        decay = torch.exp(torch.empty(proj).uniform_(math.log(0.005), math.log(1.0)))  # -g at z = dt_bias
        self.dt_bias = nn.Parameter(torch.logit(decay / -s.gate_lower_bound))
        self.A_log = nn.Parameter(torch.zeros(s.num_heads))
        self.b_proj, self.g_proj, self.o_proj = linear(hidden, s.num_heads), linear(hidden, proj), linear(proj, hidden)
        self.o_norm = nn.Module()
        self.o_norm.weight = nn.Parameter(torch.ones(dim))

    def _conv(self, x: torch.Tensor, conv: nn.Module) -> torch.Tensor:
        """x [B, T, C] -> silu(causal depthwise conv) [B, T, C]."""
        out = F.conv1d(x.transpose(1, 2), conv.weight, padding=self.width - 1, groups=x.shape[-1])
        return F.silu(out[..., : x.shape[1]].transpose(1, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        heads, dim = self.heads, self.dim
        q, k, v = (self._conv(getattr(self, f"{n}_proj")(x), getattr(self, f"{n}_conv1d")).view(b, t, heads, dim)
                   for n in ("q", "k", "v"))
        q, k = l2_normalize(q) * dim ** -0.5, l2_normalize(k)
        forget = self.f_b_proj(self.f_a_proj(x)).view(b * t, heads, dim)
        g = kda_gate(forget, self.dt_bias.view(heads, dim), self.A_log, self.lower_bound).view(b, t, heads, dim)
        beta = torch.sigmoid(self.b_proj(x))
        out = kda_chunked_batch(q, k, v, g, beta, self.chunk)
        normed = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + self.eps) * self.o_norm.weight
        gated = normed * torch.sigmoid(self.g_proj(x).view(b, t, heads, dim))
        return self.o_proj(gated.reshape(b, t, heads * dim))


class GatedMLA(nn.Module):
    """Gated NoPE MLA (K3_SPEC 3.3) in the MHA form, causal."""

    def __init__(self, s: K3Shape) -> None:
        super().__init__()
        hidden, heads = s.hidden_size, s.num_heads
        self.s = s
        self.q_a_proj, self.q_a_layernorm = linear(hidden, s.q_lora_rank), RMSNorm(s.q_lora_rank, s.rms_norm_eps)
        self.q_b_proj = linear(s.q_lora_rank, heads * s.qk_head_dim)
        self.kv_a_proj_with_mqa = linear(hidden, s.kv_lora_rank + s.qk_rope_head_dim)
        self.kv_a_layernorm = RMSNorm(s.kv_lora_rank, s.rms_norm_eps)
        self.kv_b_proj = linear(s.kv_lora_rank, heads * (s.qk_nope_head_dim + s.v_head_dim))
        self.g_proj, self.o_proj = linear(hidden, heads * s.v_head_dim), linear(heads * s.v_head_dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, (b, t, _) = self.s, x.shape
        heads = s.num_heads
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(b, t, heads, s.qk_head_dim)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([s.kv_lora_rank, s.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(c_kv)).view(b, t, heads, s.qk_nope_head_dim + s.v_head_dim)
        k_nope, v = kv.split([s.qk_nope_head_dim, s.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_pe.unsqueeze(2).expand(b, t, heads, s.qk_rope_head_dim)], dim=-1)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=True, scale=s.qk_head_dim ** -0.5)
        out = out.transpose(1, 2).reshape(b, t, heads * s.v_head_dim)
        return self.o_proj(out * torch.sigmoid(self.g_proj(x)))


class LatentMoE(nn.Module):
    """LatentMoE (K3_SPEC 3.4): sigmoid router with a selection-only bias, experts in the latent width."""

    def __init__(self, s: K3Shape) -> None:
        super().__init__()
        self.s = s
        e, lat, inter = s.num_experts, s.routed_expert_hidden_size, s.moe_intermediate_size
        self.gate = nn.Module()
        self.gate.weight = nn.Parameter(torch.randn(e, s.hidden_size) * 0.02)
        self.gate.register_buffer("e_score_correction_bias", torch.zeros(e))
        self.routed_expert_down_proj, self.routed_expert_up_proj = linear(s.hidden_size, lat), linear(lat, s.hidden_size)
        self.routed_expert_norm = RMSNorm(lat, s.rms_norm_eps)
        self.w1 = nn.Parameter(torch.randn(e, inter, lat) * lat ** -0.5)  # gate
        self.w3 = nn.Parameter(torch.randn(e, inter, lat) * lat ** -0.5)  # up
        self.w2 = nn.Parameter(torch.randn(e, lat, inter) * inter ** -0.5 * 0.5)  # down
        self.shared_experts = SiTUMLP(s.hidden_size, inter * s.num_shared_experts)
        self.last_ids: torch.Tensor | None = None  # the last training forward's choices (load balancing)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = torch.sigmoid(F.linear(x, self.gate.weight))  # [B, T, E]
        ids = (scores + self.gate.e_score_correction_bias).topk(self.s.num_experts_per_token, dim=-1).indices
        chosen = scores.gather(-1, ids)
        weights = torch.zeros_like(scores).scatter(-1, ids, chosen / (chosen.sum(-1, keepdim=True) + 1e-20))
        if self.training:
            self.last_ids = ids.detach()
        u = self.routed_expert_down_proj(x)
        w1, w3, w2 = fake_mxfp4(self.w1), fake_mxfp4(self.w3), fake_mxfp4(self.w2)
        hidden = situ_glu(torch.einsum("btl,eil->btei", u, w1), torch.einsum("btl,eil->btei", u, w3),
                          SITU_BETA, SITU_LINEAR_BETA)
        latent = torch.einsum("btei,eli,bte->btl", hidden, w2, weights)
        return self.routed_expert_up_proj(self.routed_expert_norm(latent)) + self.shared_experts(x)

    @torch.no_grad()
    def balance(self, rate: float) -> None:
        """Aux-loss-free balancing: nudge the selection bias towards equal expert load."""
        if self.last_ids is None:
            return
        load = torch.bincount(self.last_ids.flatten(), minlength=self.s.num_experts).float()
        self.gate.e_score_correction_bias += rate * torch.sign(load.mean() - load)
        self.last_ids = None
