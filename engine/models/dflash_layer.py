"""One DFlash draft layer (engine/models/dflash.py): non-causal attention of the block over itself and the
context's keys / values, then a SwiGLU MLP; with the inference fusions (one q/k/v and one gate/up matmul, one
norm and one RoPE over query and key heads together)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.models.dflash_config import DFlashConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # one fused op, the same values
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def fused_weight(owner: nn.Module, name: str, linears: tuple[nn.Module, ...]) -> Tensor | None:
    """The linears' (or norms') weights stacked along the output dim, built once and kept on `owner` (rebuilt when one is
    written again), so an inference forward runs them as one matmul; None while autograd records (training
    keeps the separate linears so gradients reach each weight)."""
    if torch.is_grad_enabled() or any(getattr(linear, "bias", None) is not None for linear in linears):
        return None
    sources = tuple(linear.weight for linear in linears)
    key = tuple((id(weight), weight._version) for weight in sources)
    cached = owner.__dict__.get(name)
    if cached is None or cached[0] != key:
        cached = (key, torch.cat(sources, dim=0), sources)  # the sources kept: their ids stay theirs
        owner.__dict__[name] = cached
    return cached[1]


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [..., T, heads, head_dim]; cos/sin: [..., T, head_dim] (half-split rotation)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(-2) + rotated * sin.unsqueeze(-2)


def signed_sin(sin: Tensor) -> Tensor:
    """sin [..., head_dim] -> cat(-sin[first half], sin[second half]): the table apply_rope_signed takes."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def apply_rope_signed(x: Tensor, cos: Tensor, sin_signed: Tensor) -> Tensor:
    """apply_rope(x, cos, sin) with sin_signed = signed_sin(sin), bit-identical (negating a factor of a product
    is exact): one roll instead of two slices, a negation and a cat."""
    return x * cos.unsqueeze(-2) + x.roll(x.shape[-1] // 2, -1) * sin_signed.unsqueeze(-2)


class DFlashLayer(nn.Module):
    """Pre-norm decoder layer whose attention also reads the context entries."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, d
        self.input_norm = RMSNorm(h, config.rms_norm_eps)
        self.q_proj = nn.Linear(h, config.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, config.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, config.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(config.num_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        self.k_norm = RMSNorm(d, config.rms_norm_eps)
        self.post_attention_norm = RMSNorm(h, config.rms_norm_eps)
        self.gate_proj = nn.Linear(h, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, h, bias=False)

    def keys_values(self, x: Tensor, cos: Tensor, sin: Tensor, projected: tuple[Tensor, Tensor] | None = None,
                    ) -> tuple[Tensor, Tensor]:
        """x: [..., T, hidden] -> roped keys, values: [..., T, kv_heads, head_dim]. projected: (k_proj(x),
        v_proj(x)) when the caller already has them."""
        shape = (*x.shape[:-1], self.num_kv_heads, self.head_dim)
        k, v = projected if projected is not None else (self.k_proj(x), self.v_proj(x))
        keys = apply_rope(self.k_norm(k.view(shape)), cos, sin)
        return keys, v.view(shape)

    def _qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q_proj(x), k_proj(x), v_proj(x): one matmul over the stacked weights at inference."""
        weight = fused_weight(self, "_qkv_weight", (self.q_proj, self.k_proj, self.v_proj))
        if weight is None:
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)
        kv = self.num_kv_heads * self.head_dim
        return F.linear(x, weight).split([self.num_heads * self.head_dim, kv, kv], dim=-1)

    def _mlp(self, x: Tensor) -> Tensor:
        """down(silu(gate(x)) * up(x)), gate and up as one matmul at inference."""
        weight = fused_weight(self, "_gate_up_weight", (self.gate_proj, self.up_proj))
        if weight is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate, up = F.linear(x, weight).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)

    def _fused_queries_keys(self, x: Tensor, cos: Tensor, sin: Tensor, sin_is_plain: bool,
                            ) -> tuple[Tensor, Tensor, Tensor] | None:
        """Roped, normed queries and keys and the values, bit-identical to the per-projection path, in a few ops:
        one qkv matmul, ONE rms_norm over the query and key heads together (weighted by the stacked q_norm /
        k_norm weights) and ONE RoPE over both. Inference on float32 only (None otherwise: training keeps the
        separate modules, other dtypes round between the norm and its weight)."""
        if x.dtype != torch.float32 or self.q_norm.weight.dtype != torch.float32:
            return None
        weight = fused_weight(self, "_qkv_weight", (self.q_proj, self.k_proj, self.v_proj))
        scale = fused_weight(self, "_qk_norm_weight", (self.q_norm,) * self.num_heads + (self.k_norm,) * self.num_kv_heads)
        if weight is None or scale is None:
            return None
        normed = self.num_heads + self.num_kv_heads
        rows = F.linear(x, weight).unflatten(-1, (normed + self.num_kv_heads, self.head_dim))
        both = F.rms_norm(rows[..., :normed, :], (self.head_dim,), eps=self.q_norm.eps) * scale.view(normed, self.head_dim)
        both = apply_rope_signed(both, cos, signed_sin(sin) if sin_is_plain else sin)
        queries, keys = both.split([self.num_heads, self.num_kv_heads], dim=-2)
        return queries, keys, rows[..., normed:, :]

    def context_entry(self, feature: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """feature: [..., T, hidden] -> [..., T, draft_dim] = cat(k roped, v)."""
        keys, values = self.keys_values(feature, cos, sin)
        return torch.cat((keys.flatten(-2), values.flatten(-2)), dim=-1)

    def forward(self, hidden: Tensor, cos: Tensor, sin: Tensor, context: Tensor, mask: Tensor | None,
                sin_signed: Tensor | None = None) -> Tensor:
        """hidden: [S, Q, hidden]; context: [S, C, draft_dim]; mask: [S, Q, C + Q] (True = attend) or None (every
        row sees everything). sin_signed: signed_sin(sin) when the caller has it (the inference path uses it)."""
        s, q_len, _ = hidden.shape
        x = self.input_norm(hidden)
        fused = self._fused_queries_keys(x, cos, sin_signed if sin_signed is not None else sin, sin_signed is None)
        if fused is not None:
            queries, keys, values = fused
        else:
            q, k, v = self._qkv(x)
            queries = apply_rope(self.q_norm(q.view(s, q_len, self.num_heads, self.head_dim)), cos, sin)
            keys, values = self.keys_values(x, cos, sin, (k, v))
        half = context.shape[-1] // 2
        heads = (self.num_kv_heads, self.head_dim)
        keys = torch.cat((context[..., :half].unflatten(-1, heads), keys), dim=1)
        values = torch.cat((context[..., half:].unflatten(-1, heads), values), dim=1)
        attended = F.scaled_dot_product_attention(
            queries.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
            attn_mask=None if mask is None else mask.unsqueeze(1), enable_gqa=True,
        )
        hidden = hidden + self.o_proj(attended.transpose(1, 2).reshape(s, q_len, -1))
        return hidden + self._mlp(self.post_attention_norm(hidden))
