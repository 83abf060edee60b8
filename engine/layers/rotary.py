"""Rotary position embedding: default and YaRN frequencies, half-split or interleaved pair layout.

Matches transformers' DeepseekV3RotaryEmbedding + apply_rotary_pos_emb(_interleave) exactly:
cos/sin = cos/sin(position * inv_freq) * attention_scaling, cast to the activation dtype.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from engine.model_configs.model_config import RopeConfig


def rope_inv_freq(rope: RopeConfig, dim: int) -> torch.Tensor:
    """[dim // 2] float32 inverse frequencies (YaRN blends interpolated and extrapolated ones)."""
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    if rope.rope_type == "default":
        return 1.0 / pos_freqs
    original = rope.original_max_position_embeddings

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    return (1.0 / (rope.factor * pos_freqs)) * (1 - extrapolation_weight) + (1.0 / pos_freqs) * extrapolation_weight


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q_pe [T, H, dim] and k_pe [T, dim] at absolute positions [T]."""

    def __init__(self, rope: RopeConfig, dim: int, interleave: bool) -> None:
        super().__init__()
        self.dim = dim
        self.interleave = interleave
        self.scaling = rope.cos_sin_scale
        self.rope = rope
        self.register_buffer("inv_freq", rope_inv_freq(rope, dim), persistent=False)
        self._memo: tuple[torch.Tensor, torch.dtype, torch.Tensor, torch.Tensor] | None = None

    def init_buffers(self) -> None:
        """inv_freq computed again on its device (after a model built on the meta device is allocated)."""
        self.inv_freq = rope_inv_freq(self.rope, self.dim).to(self.inv_freq.device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] -> cos, sin: [T, dim // 2] (the angle of each rotated pair)."""
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]
        return (freqs.cos() * self.scaling).to(dtype), (freqs.sin() * self.scaling).to(dtype)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.interleave:
            x1, x2 = x[..., 0::2], x[..., 1::2]
            return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        half = self.dim // 2
        x1, x2 = x[..., :half], x[..., half:]
        cos2, sin2 = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
        return x * cos2 + torch.cat([-x2, x1], dim=-1) * sin2

    def forward(
        self, positions: torch.Tensor, q_pe: torch.Tensor, k_pe: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q_pe: [T, H, dim], k_pe: [T, dim] -> rotated (interleaved input pairs come out half-split).

        cos/sin are computed once per positions tensor: layers sharing this module (one per model) reuse
        the first layer's angles for the rest of the step."""
        memo = self._memo
        if memo is not None and memo[0] is positions and memo[1] == q_pe.dtype:
            cos, sin = memo[2], memo[3]
        else:
            cos, sin = self.cos_sin(positions, q_pe.dtype)
            self._memo = (positions, q_pe.dtype, cos, sin)
        return self._rotate(q_pe, cos[:, None, :], sin[:, None, :]), self._rotate(k_pe, cos, sin)
