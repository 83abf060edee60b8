"""Attention Residuals (Kimi K3): the residual adds are replaced by softmax mixes over block sums.

The stream of one forward holds a bank of finished block sums (rows [T, hidden] each: the embedding,
then the sum of the outputs of every attn_res_block_size layers) and a running partial sum P of the
current block. Every consumer (a layer's attention, its MLP, the output head) reads
  Agg = sum_j p_j v_j,  p = softmax_j(proj(RMSNorm(v_j)))  over v = bank rows + [P],
i.e. a learnt one-scalar score per row on the normalised row, mixing the RAW rows (float32 softmax and
accumulation, cast back), followed by that consumer's ordinary RMSNorm (applied by the caller).
Layer i with i % block_size == 0 appends the pre-attention P to the bank and restarts P at zero.
Everything is per token: there is no state across forwards, so chunked prefill needs nothing here.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.layers.norm import RMSNorm


def attn_res_mix(rows: torch.Tensor, proj_weight: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
    """rows: [T, R, hidden] (bank rows then the partial), proj_weight: [1, hidden] -> [T, hidden] in rows' dtype."""
    if rows.shape[1] == 1:
        return rows[:, 0]  # softmax over one row is 1
    scores = (norm(rows).float() * proj_weight.float().view(-1)).sum(dim=-1)  # [T, R]
    weights = torch.softmax(scores, dim=-1)
    return (weights.unsqueeze(-1) * rows.float()).sum(dim=1).to(rows.dtype)


@dataclass
class ResidualStream:
    """The AttnRes state of one forward: bank rows (each [T, hidden]) and the partial sum P [T, hidden]."""

    partial: torch.Tensor
    bank: list[torch.Tensor] = field(default_factory=list)

    def mix(self, proj_weight: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """Agg over the bank rows and P, before the consumer's own norm: [T, hidden]."""
        return attn_res_mix(torch.stack([*self.bank, self.partial], dim=1), proj_weight, norm)

    def close_block(self) -> None:
        """Appends P to the bank as a finished block row and restarts P at zero."""
        self.bank.append(self.partial)
        self.partial = torch.zeros_like(self.partial)

    def add(self, x: torch.Tensor) -> None:
        """P += x (a layer's attention or MLP output)."""
        self.partial = self.partial + x.to(self.partial.dtype)


def is_block_start(layer_index: int, block_size: int) -> bool:
    """Layers 0, block_size, 2*block_size, ... close a block before their attention."""
    if block_size <= 0:
        raise ValueError(f"attn_res_block_size must be positive, got {block_size}")
    return layer_index % block_size == 0
