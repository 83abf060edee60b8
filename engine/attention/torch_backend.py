"""Reference attention in plain PyTorch: varlen MHA-form prefill and absorbed decode over the paged cache.

Correctness first: every sequence is computed separately, scores and softmax in float32, causal
mask aligned bottom-right. Every other backend is tested against this one.
"""
from __future__ import annotations

import itertools

import torch

from engine.attention.base import AttentionBackend, VarlenSpans
from engine.forward_batch import AttentionMetadata


# Queries are processed in row blocks so the float32 score matrix [H, rows, Lk] stays under ~256 MiB.
_SCORE_BUDGET = 64 * 1024 * 1024  # elements


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [Lq, H, Dqk], k: [Lk, H, Dqk] (or [Lk, Dqk] shared by all heads), v: [Lk, H, Dv] (or [Lk, Dv])
    -> [Lq, H, Dv] float32; query j sees keys 0 .. Lk - Lq + j.

    Explicit matmul + softmax in float32 (measured on CPU: as fast as SDPA, which slows down when
    Dqk != Dv, and exact in float32 for bf16 inputs)."""
    q_len, k_len, heads = q.shape[0], k.shape[0], q.shape[1]
    keys = k.float().t() if k.dim() == 2 else k.float().permute(1, 2, 0)  # [Dqk, Lk] or [H, Dqk, Lk]
    values = v.float() if v.dim() == 2 else v.float().transpose(0, 1)  # [Lk, Dv] or [H, Lk, Dv]
    out = torch.empty(heads, q_len, values.shape[-1], dtype=torch.float32, device=q.device)
    block = max(1, _SCORE_BUDGET // max(1, heads * k_len))
    cols = torch.arange(k_len, device=q.device).unsqueeze(0)
    for start in range(0, q_len, block):
        end = min(q_len, start + block)
        scores = torch.matmul(q[start:end].float().transpose(0, 1), keys).mul_(scale)  # [H, rows, Lk]
        rows = torch.arange(start, end, device=q.device).unsqueeze(1) + (k_len - q_len)
        scores.masked_fill_(cols > rows, float("-inf"))
        out[:, start:end] = torch.matmul(torch.softmax(scores, dim=-1), values)
    return out.transpose(0, 1)


def gather_context(kv_cache: torch.Tensor, block_table_row: torch.Tensor, kv_len: int) -> torch.Tensor:
    """kv_cache: [num_pages, page_size, D], block_table_row: [max_pages] -> the first kv_len entries [kv_len, D]."""
    page_size = kv_cache.shape[1]
    num_pages = -(-kv_len // page_size)
    pages = block_table_row[:num_pages].long()
    return kv_cache.index_select(0, pages).reshape(num_pages * page_size, kv_cache.shape[-1])[:kv_len]


class TorchAttentionBackend(AttentionBackend):
    """Exact reference implementation; runs any head count on any device."""

    name = "torch"

    def supports_num_heads(self, num_heads: int) -> bool:
        return num_heads > 0

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans: VarlenSpans,
                softmax_scale: float) -> torch.Tensor:
        """q: [Tq, H, Dqk], k: [Tk, H, Dqk], v: [Tk, H, Dv] -> [Tq, H, Dv] in q's dtype."""
        out = torch.empty(q.shape[0], q.shape[1], v.shape[-1], dtype=q.dtype, device=q.device)
        heads = q.shape[1]
        q_lens, k_lens = spans.q_lens, spans.k_lens  # rows packed back to back (k_len >= q_len: checked by spans)
        q_starts, k_starts = list(itertools.accumulate(q_lens, initial=0)), list(itertools.accumulate(k_lens, initial=0))
        # Many short sequences: padded batched matmuls; long ones: one at a time in row blocks.
        short = [i for i in range(len(q_lens)) if heads * q_lens[i] * k_lens[i] * 8 <= _SCORE_BUDGET]
        if len(short) > 1:
            _prefill_group(q, k, v, short, q_lens, k_lens, q_starts, k_starts, softmax_scale, out)
        for i in range(len(q_lens)):
            if len(short) > 1 and i in short:
                continue
            qs, ks = q_starts[i], k_starts[i]
            out[qs : qs + q_lens[i]] = _causal_attention(
                q[qs : qs + q_lens[i]], k[ks : ks + k_lens[i]], v[ks : ks + k_lens[i]], softmax_scale
            ).to(q.dtype)
        return out

    def decode(self, q: torch.Tensor, kv_cache: torch.Tensor, attn: AttentionMetadata, softmax_scale: float,
               latent_dim: int) -> torch.Tensor:
        if attn.num_seqs > 1:
            return _batched_decode(q, kv_cache, attn, softmax_scale, latent_dim)
        out = torch.empty(q.shape[0], q.shape[1], latent_dim, dtype=q.dtype, device=q.device)
        start = 0
        for i, (q_len, kv_len) in enumerate(zip(attn.q_lens_cpu, attn.kv_lens_cpu)):
            context = gather_context(kv_cache, attn.block_table[i], kv_len)  # [kv_len, D]
            out[start : start + q_len] = _causal_attention(
                q[start : start + q_len], context, context[:, :latent_dim], softmax_scale
            ).to(q.dtype)
            start += q_len
        return out


def _batched_decode(
    q: torch.Tensor, kv_cache: torch.Tensor, attn: AttentionMetadata, scale: float, latent_dim: int
) -> torch.Tensor:
    """Decode for many sequences at once: each group of sequences is padded to its longest context
    and query count, masked (padding and bottom-right causal), and computed with batched matmuls.
    Same maths as the per-sequence path; groups keep the float32 score tensor within _SCORE_BUDGET."""
    heads, dim = q.shape[1], kv_cache.shape[-1]
    page_size = kv_cache.shape[1]
    flat_cache = kv_cache.reshape(-1, dim)
    out = torch.empty(q.shape[0], heads, latent_dim, dtype=q.dtype, device=q.device)
    q_lens, kv_lens = attn.q_lens_cpu, attn.kv_lens_cpu
    starts = [0]
    for length in q_lens:
        starts.append(starts[-1] + length)
    first = 0
    while first < len(q_lens):
        last = first + 1
        while last < len(q_lens):
            width = max(kv_lens[first : last + 1]) * max(q_lens[first : last + 1]) * heads
            if (last + 1 - first) * width > _SCORE_BUDGET:
                break
            last += 1
        _decode_group(q, flat_cache, page_size, attn, range(first, last), starts, scale, latent_dim, out)
        first = last
    return out


def _decode_group(q, flat_cache, page_size, attn, group, starts, scale, latent_dim, out) -> None:
    device = q.device
    seqs = list(group)
    q_lens = [attn.q_lens_cpu[i] for i in seqs]
    kv_lens = [attn.kv_lens_cpu[i] for i in seqs]
    q_max, kv_max = max(q_lens), max(kv_lens)
    positions = torch.arange(kv_max, device=device)
    table = attn.block_table[seqs[0] : seqs[-1] + 1].long()
    pages = table[:, (positions // page_size).clamp_max(table.shape[1] - 1)]
    slots = pages * page_size + positions % page_size  # [S, kv_max]
    context = flat_cache.index_select(0, slots.reshape(-1)).view(len(seqs), kv_max, -1).float()  # [S, L, D]
    rows = torch.tensor(
        [starts[i] + min(j, q_len - 1) for i, q_len in zip(seqs, q_lens) for j in range(q_max)], device=device
    )
    heads = q.shape[1]
    # Heads folded into the query axis: plain batched matmuls, no broadcast copies of the context.
    queries = q.index_select(0, rows).view(len(seqs), q_max, heads, -1).float().transpose(1, 2)  # [S, H, Q, D]
    queries = queries.reshape(len(seqs), heads * q_max, -1)
    scores = torch.bmm(queries, context.transpose(1, 2)).mul_(scale).view(len(seqs), heads, q_max, kv_max)
    q_len_t = torch.tensor(q_lens, device=device).view(-1, 1, 1)
    kv_len_t = torch.tensor(kv_lens, device=device).view(-1, 1, 1)
    query_pos = torch.arange(q_max, device=device).view(1, -1, 1)
    visible = positions.view(1, 1, -1) <= kv_len_t - q_len_t + query_pos  # [S, Q, L]
    scores.masked_fill_(~visible.unsqueeze(1), float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(len(seqs), heads * q_max, kv_max)
    result = torch.bmm(probs, context[:, :, :latent_dim]).view(len(seqs), heads, q_max, latent_dim)
    result = result.transpose(1, 2)  # [S, Q, H, latent]
    for index, (i, q_len) in enumerate(zip(seqs, q_lens)):
        out[starts[i] : starts[i] + q_len] = result[index, :q_len].to(out.dtype)


def _prefill_group(q, k, v, seqs, q_lens, k_lens, q_starts, k_starts, scale, out) -> None:
    """Padded batched prefill over the sequences `seqs`, split so each score tensor fits _SCORE_BUDGET."""
    heads, device = q.shape[1], q.device
    first = 0
    while first < len(seqs):
        last = first + 1
        while last < len(seqs):
            group = seqs[first : last + 1]
            size = len(group) * heads * max(q_lens[i] for i in group) * max(k_lens[i] for i in group)
            if size > _SCORE_BUDGET:
                break
            last += 1
        group = seqs[first:last]
        first = last
        q_max, k_max = max(q_lens[i] for i in group), max(k_lens[i] for i in group)
        q_rows = torch.tensor([q_starts[i] + min(j, q_lens[i] - 1) for i in group for j in range(q_max)], device=device)
        k_rows = torch.tensor([k_starts[i] + min(j, k_lens[i] - 1) for i in group for j in range(k_max)], device=device)
        queries = q.index_select(0, q_rows).view(len(group), q_max, heads, -1).float().transpose(1, 2)
        keys = k.index_select(0, k_rows).view(len(group), k_max, heads, -1).float().permute(0, 2, 3, 1)
        values = v.index_select(0, k_rows).view(len(group), k_max, heads, -1).float().transpose(1, 2)
        scores = torch.matmul(queries, keys).mul_(scale)  # [S, H, Q, K]
        q_len_t = torch.tensor([q_lens[i] for i in group], device=device).view(-1, 1, 1)
        k_len_t = torch.tensor([k_lens[i] for i in group], device=device).view(-1, 1, 1)
        visible = torch.arange(k_max, device=device).view(1, 1, -1) <= (
            k_len_t - q_len_t + torch.arange(q_max, device=device).view(1, -1, 1)
        )
        scores.masked_fill_(~visible.unsqueeze(1), float("-inf"))
        result = torch.matmul(torch.softmax(scores, dim=-1), values).transpose(1, 2)  # [S, Q, H, Dv]
        for index, i in enumerate(group):
            out[q_starts[i] : q_starts[i] + q_lens[i]] = result[index, : q_lens[i]].to(out.dtype)
