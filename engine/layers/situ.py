"""SiTU-GLU (Kimi K3's activation) and the dense SiTU MLP (K3's layer 0 and shared experts).

SiTU-GLU(g, u) = beta * tanh(g / beta) * sigmoid(g) * linear_beta * tanh(u / linear_beta), computed in
float32 and cast back (K3: beta 4, linear_beta 25): a soft-capped SiLU gate times a soft-capped up value.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.runtime.distributed import TPGroup
from engine.layers.linear import ColumnParallelLinear, RowParallelLinear


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    """gate, up: [..., I] -> [..., I] in gate's dtype (float32 maths)."""
    g, u = gate.float(), up.float()
    out = beta * torch.tanh(g / beta) * torch.sigmoid(g) * (linear_beta * torch.tanh(u / linear_beta))
    return out.to(gate.dtype)


def situ_glu_fused(gate_up: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    """gate_up: [..., 2I] (gate half first) -> [..., I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return situ_glu(gate, up, beta, linear_beta)


class SiTUMLP(nn.Module):
    """x [T, hidden] -> down(SiTU-GLU(gate(x), up(x))) [T, hidden]: gate/up column-parallel, down row-parallel.

    reduce=False leaves the row-parallel partial sum for the caller to all-reduce."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, tp: TPGroup, dtype: torch.dtype,
        beta: float, linear_beta: float, reduce: bool = True,
    ) -> None:
        super().__init__()
        self.beta, self.linear_beta = beta, linear_beta
        self.gate_proj = ColumnParallelLinear(hidden_size, intermediate_size, tp, dtype)
        self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, tp, dtype)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, tp, dtype, reduce=reduce)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(situ_glu(self.gate_proj(x), self.up_proj(x), self.beta, self.linear_beta))
