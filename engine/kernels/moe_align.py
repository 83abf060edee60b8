"""Routing for the fused MoE kernel: (token, slot) assignments sorted by expert, each expert's run padded
to a multiple of the kernel's row block, in pure torch with no device-to-host sync and sizes fixed by the
shapes alone (so a CUDA graph can capture it).

Example (block_m 4, 3 experts, T*k = 5 assignments with local ids [2, 0, 2, 1, 0]):
    sorted_ids   = [1, 4, S, S,  3, S, S, S,  0, 2, S, S,  S, ...]   (S = sentinel T*k: padding)
    block_expert = [0, 1, 2, -1, ...]                                 (-1: unused block)
    num_padded   = 12
"""
from __future__ import annotations

from typing import NamedTuple

import torch


class AlignedRouting(NamedTuple):
    """sorted_ids: [max_padded] int32 flat (token * top_k + slot) indices grouped by expert, sentinel
    num_tokens * top_k in the padding; block_expert: [max_padded / block_m] int32 local expert of each
    row block (-1 past the used blocks); num_padded: [1] int32 rows in use (a multiple of block_m)."""

    sorted_ids: torch.Tensor
    block_expert: torch.Tensor
    num_padded: torch.Tensor
    block_m: int


def max_padded_rows(num_assignments: int, num_experts: int, block_m: int) -> int:
    """Upper bound of the padded row count: every active expert wastes less than one block."""
    blocks = -(-num_assignments // block_m) + min(num_experts, num_assignments)
    return max(blocks, 1) * block_m


def align_by_expert(local_ids: torch.Tensor, num_experts: int, block_m: int) -> AlignedRouting:
    """local_ids: [T, k] int (ids outside [0, num_experts) belong to other ranks and are left out)."""
    if block_m < 1 or num_experts < 1:
        raise ValueError(f"block_m and num_experts must be positive, got {block_m} and {num_experts}")
    device = local_ids.device
    flat = local_ids.reshape(-1).long()
    total = flat.numel()
    max_rows = max_padded_rows(total, num_experts, block_m)
    key = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)  # other ranks' slots sort last
    order = torch.argsort(key, stable=True)
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    counts = counts[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    count_start = torch.cumsum(counts, 0) - counts
    sorted_key = key[order]
    expert = sorted_key.clamp(max=num_experts - 1)
    rank = torch.arange(total, device=device) - count_start[expert]
    destination = torch.where(sorted_key < num_experts, padded_end[expert] - padded[expert] + rank, max_rows)
    sorted_ids = torch.full((max_rows + 1,), total, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, destination, order.to(torch.int32))
    block_start = torch.arange(0, max_rows, block_m, device=device)
    block_expert = torch.searchsorted(padded_end, block_start, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    num_padded = padded_end[-1:].to(torch.int32)
    return AlignedRouting(sorted_ids[:max_rows], block_expert, num_padded, block_m)
