"""SwiGLU MLP (dense layers and shared experts): gate/up column-parallel, down row-parallel."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.runtime.distributed import TPGroup
from engine.layers.linear import ColumnParallelLinear, RowParallelLinear


class DenseMLP(nn.Module):
    """x [T, hidden] -> down(silu(gate(x)) * up(x)) [T, hidden].

    reduce=False leaves the row-parallel partial sum un-reduced (the MoE block reduces it together
    with the routed experts' output)."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp: TPGroup, dtype: torch.dtype, reduce: bool = True) -> None:
        super().__init__()
        self.gate_proj = ColumnParallelLinear(hidden_size, intermediate_size, tp, dtype)
        self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, tp, dtype)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, tp, dtype, reduce=reduce)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
