"""Tensor-parallel linear layers; each forward shows the collective it needs (no hidden hooks).

Weights are [out_features, in_features] as in nn.Linear; no bias (DeepSeek-V3 has none). On the CPU a
few-row float32 matmul goes through oneDNN with a packed weight (engine/kernels/cpu_linear.py).
"""
from __future__ import annotations

import torch
from torch import nn

from engine.runtime.distributed import TPGroup
from engine.kernels.cpu_linear import linear


class _Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}"


class ReplicatedLinear(_Linear):
    """Full weight on every rank: x [T, in] -> [T, out], identical everywhere."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)


class ColumnParallelLinear(_Linear):
    """Output features split over ranks (weight rows [rank*out/tp, (rank+1)*out/tp)).

    x [T, in] (replicated) -> [T, out / tp] (this rank's slice); no communication."""

    def __init__(self, in_features: int, out_features: int, tp: TPGroup, dtype: torch.dtype) -> None:
        start, end = tp.shard_range(out_features)
        super().__init__(in_features, end - start, dtype)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)


class RowParallelLinear(_Linear):
    """Input features split over ranks: x [T, in / tp] -> [T, out], summed over ranks with all_reduce.

    reduce=False returns this rank's partial sum so that a caller (the MoE block) can fuse several
    partial sums into one all_reduce."""

    def __init__(self, in_features: int, out_features: int, tp: TPGroup, dtype: torch.dtype, reduce: bool = True) -> None:
        start, end = tp.shard_range(in_features)
        super().__init__(end - start, out_features, dtype)
        self.tp = tp
        self.reduce = reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = linear(x, self.weight)
        if self.reduce:
            out = self.tp.all_reduce(out)
        return out
