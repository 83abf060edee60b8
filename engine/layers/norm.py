"""RMSNorm computed in float32 and cast back, as transformers' DeepseekV3RMSNorm."""
from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """x: [..., dim] -> weight * (x / rms(x)) with the statistics in float32; replicated on every rank."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(input_dtype)
