"""Unquantised routed experts (a K3 / Kimi Linear checkpoint without quantization_config: plain
experts.N.{w1,w2,w3}.weight in bf16 or fp32, as after dequantising or fine-tuning), with PackedExperts'
interface so LatentMoE runs either the same way:

  w13 [E, 2I, hidden] (w1 = gate rows, then w3 = up rows), w2 [E, hidden, I] (down), in the model's dtype,
where hidden is the experts' input width (LatentMoE: the latent width).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class DenseExperts(nn.Module):
    """The routed experts of one layer on one rank, as plain weights."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.register_buffer("w13", torch.zeros(num_experts, 2 * intermediate_size, hidden_size, dtype=dtype))
        self.register_buffer("w2", torch.zeros(num_experts, hidden_size, intermediate_size, dtype=dtype))

    def target(self, expert: int, projection: str, part: str) -> torch.Tensor:
        """The slice a checkpoint tensor experts.{expert}.{w1|w2|w3}.weight is copied into."""
        if part != "weight" or projection not in ("w1", "w2", "w3"):
            raise ValueError(f"unknown unquantised expert tensor {projection}.{part}")
        if projection == "w2":
            return self.w2[expert]
        inter = self.intermediate_size
        return self.w13[expert, :inter] if projection == "w1" else self.w13[expert, inter:]

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(gate_up [E, 2I, hidden], down [E, hidden, I]) in float32 for the dense CPU path: the weights
        themselves when they are float32 off CUDA; None otherwise (each selected expert runs on its own)."""
        if self.w13.is_cuda or self.w13.dtype != torch.float32:
            return None
        return self.w13, self.w2

    def gate_up(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, 2I] float32 (gate columns then up columns)."""
        return F.linear(x.to(self.w13.dtype), self.w13[expert]).float()

    def down(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """x [T, I] -> [T, hidden] float32."""
        return F.linear(x.to(self.w2.dtype), self.w2[expert]).float()

    @property
    def resident_bytes(self) -> int:
        return sum(buffer.numel() * buffer.element_size() for buffer in self.buffers())
