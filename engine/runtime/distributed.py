"""Tensor-parallel group: the collectives every TP-aware layer calls explicitly in forward."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    """rank / size of this process in its tensor-parallel group. size == 1 makes every collective a no-op."""

    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"bad tensor-parallel rank {self.rank} of size {self.size}")

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums x over ranks in place and returns it."""
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenates every rank's x along dim (rank order)."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=dim)

    def shard_range(self, total: int) -> tuple[int, int]:
        """[start, end) of this rank's equal share of `total` (must divide evenly)."""
        if total % self.size:
            raise ValueError(f"{total} does not divide over {self.size} tensor-parallel ranks")
        per = total // self.size
        return self.rank * per, (self.rank + 1) * per
