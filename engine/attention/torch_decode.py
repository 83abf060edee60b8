"""The torch backend's absorbed decode: every sequence of a step in padded batched matmuls over the paged
latent cache, with the step's layout (which cache slots, which mask, which query rows) built ONCE per step
and reused by every layer.

Sequences are split into groups whose float32 score tensor [S, H * Q, L] fits a budget; inside a group each
sequence is padded to the group's longest context L and query count Q. Padding context positions and
positions a query may not see (causal, bottom-right) are masked to -inf; padding query rows are computed
and dropped. When every sequence of a group has Q queries (plain decode: Q = 1; speculative verify with one
block size) the queries are a view of q and the output is written back in one copy, with no gather.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.runtime.devices import host_to_device
from engine.runtime.forward_batch import AttentionMetadata


@dataclass(frozen=True)
class DecodeGroup:
    """Sequences [first, last) of a step, their query rows [token_start, token_end) of q.

    slots: [S * kv_max] int64 cache slots of every (sequence, context position), padding reads a real slot
    hidden: [S, 1, Q, L] bool, True where the score is masked; None when no score is masked
    rows: [S * Q] int64 query rows of q (padding rows repeat a sequence's last query); None when uniform
    valid: [token_end - token_start] int64 rows of the padded [S * Q] output that are real; None when uniform
    """

    first: int
    last: int
    token_start: int
    token_end: int
    q_max: int
    kv_max: int
    slots: torch.Tensor
    hidden: torch.Tensor | None
    rows: torch.Tensor | None
    valid: torch.Tensor | None

    @property
    def num_seqs(self) -> int:
        return self.last - self.first


def split_groups(q_lens: tuple[int, ...], kv_lens: tuple[int, ...], heads: int, budget: int) -> list[tuple[int, int]]:
    """Consecutive [first, last) ranges of sequences whose padded score tensor S * H * Q * L fits `budget`
    elements (a sequence alone always forms a group)."""
    groups, first = [], 0
    while first < len(q_lens):
        last = first + 1
        while last < len(q_lens):
            width = max(kv_lens[first : last + 1]) * max(q_lens[first : last + 1]) * heads
            if (last + 1 - first) * width > budget:
                break
            last += 1
        groups.append((first, last))
        first = last
    return groups


def build_group(attn: AttentionMetadata, first: int, last: int, token_start: int) -> DecodeGroup:
    """The layout of sequences [first, last) whose queries start at row token_start of q."""
    device = attn.block_table.device
    q_lens, kv_lens = attn.q_lens_cpu[first:last], attn.kv_lens_cpu[first:last]
    q_max, kv_max = max(q_lens), max(kv_lens)
    page_size = attn.page_size
    positions = torch.arange(kv_max, device=device)
    table = attn.block_table[first:last].long()
    pages = table[:, (positions // page_size).clamp_max(table.shape[1] - 1)]
    slots = (pages * page_size + positions % page_size).reshape(-1)
    hidden = None
    if q_max > 1 or min(kv_lens) < kv_max:
        q_len_t = host_to_device(q_lens, torch.int64, device).view(-1, 1, 1)
        kv_len_t = host_to_device(kv_lens, torch.int64, device).view(-1, 1, 1)
        query_pos = torch.arange(q_max, device=device).view(1, -1, 1)
        hidden = (positions.view(1, 1, -1) > kv_len_t - q_len_t + query_pos).unsqueeze(1)  # [S, 1, Q, L]
    rows = valid = None
    if min(q_lens) < q_max:
        starts, row_list, valid_list = token_start, [], []
        for index, q_len in enumerate(q_lens):
            row_list += [starts + min(j, q_len - 1) for j in range(q_max)]
            valid_list += [index * q_max + j for j in range(q_len)]
            starts += q_len
        rows = host_to_device(row_list, torch.int64, device)
        valid = host_to_device(valid_list, torch.int64, device)
    return DecodeGroup(first, last, token_start, token_start + sum(q_lens), q_max, kv_max, slots, hidden, rows, valid)


def build_decode_layout(attn: AttentionMetadata, heads: int, budget: int) -> tuple[DecodeGroup, ...]:
    """Every group of a step (see split_groups), built from the metadata's host lengths and block table."""
    groups, token_start = [], 0
    for first, last in split_groups(attn.q_lens_cpu, attn.kv_lens_cpu, heads, budget):
        group = build_group(attn, first, last, token_start)
        groups.append(group)
        token_start = group.token_end
    return tuple(groups)


def decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, layout: tuple[DecodeGroup, ...], scale: float,
                     latent_dim: int) -> torch.Tensor:
    """q: [T, H, D] absorbed queries, kv_cache: [pages, page_size, D] -> [T, H, latent_dim] in q's dtype."""
    heads, dim = q.shape[1], kv_cache.shape[-1]
    flat_cache = kv_cache.reshape(-1, dim)
    out = torch.empty(q.shape[0], heads, latent_dim, dtype=q.dtype, device=q.device)
    for group in layout:
        count, q_max, kv_max = group.num_seqs, group.q_max, group.kv_max
        context = flat_cache.index_select(0, group.slots).view(count, kv_max, dim).float()  # [S, L, D]
        own = q[group.token_start : group.token_end] if group.rows is None else q.index_select(0, group.rows)
        queries = own.view(count, q_max, heads, dim).float().transpose(1, 2).reshape(count, heads * q_max, dim)
        scores = torch.bmm(queries, context.transpose(1, 2)).mul_(scale)  # [S, H * Q, L]
        if group.hidden is not None:
            scores.view(count, heads, q_max, kv_max).masked_fill_(group.hidden, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        result = torch.bmm(probs, context[:, :, :latent_dim]).view(count, heads, q_max, latent_dim)
        result = result.transpose(1, 2).reshape(count * q_max, heads, latent_dim)  # [S * Q, H, latent]
        if group.valid is not None:
            result = result.index_select(0, group.valid)
        out[group.token_start : group.token_end] = result
    return out
