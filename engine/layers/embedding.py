"""Vocab-parallel token embedding and LM head: each rank holds rows [rank*V/tp, (rank+1)*V/tp)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.runtime.distributed import TPGroup
from engine.kernels.cpu_linear import linear


class VocabParallelEmbedding(nn.Module):
    """input_ids [T] -> [T, hidden]: rows outside this rank's shard are zero, then all_reduce."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup, dtype: torch.dtype) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_start, self.vocab_end = tp.shard_range(vocab_size)
        self.weight = nn.Parameter(
            torch.empty(self.vocab_end - self.vocab_start, hidden_size, dtype=dtype), requires_grad=False
        )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        in_shard = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = torch.where(in_shard, input_ids - self.vocab_start, torch.zeros_like(input_ids))
        out = F.embedding(local_ids, self.weight) * in_shard.unsqueeze(-1).to(self.weight.dtype)
        return self.tp.all_reduce(out)


class ParallelLMHead(nn.Module):
    """hidden [N, hidden] -> logits [N, vocab] float32 on every rank (local slice, then all_gather)."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup, dtype: torch.dtype) -> None:
        super().__init__()
        self.tp = tp
        start, end = tp.shard_range(vocab_size)
        self.weight = nn.Parameter(torch.empty(end - start, hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local_logits = linear(hidden, self.weight).float()
        return self.tp.all_gather(local_logits, dim=-1)
