"""Reference attention in plain PyTorch: varlen MHA-form prefill and absorbed decode over the paged cache.

Correctness first: every sequence is computed separately, scores and softmax in float32, causal
mask aligned bottom-right. Every other backend is tested against this one.
"""
from __future__ import annotations

import itertools

import torch

from engine.runtime.devices import host_to_device
from engine.attention.base import AttentionBackend, VarlenSpans
from engine.attention.torch_decode import DecodeGroup, build_decode_layout, decode_attention
from engine.runtime.forward_batch import AttentionMetadata


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

    def __init__(self) -> None:
        self._layout: tuple[AttentionMetadata, int, tuple[DecodeGroup, ...]] | None = None

    def decode(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        attn: AttentionMetadata,
        softmax_scale: float,
        latent_dim: int,
    ) -> torch.Tensor:
        """q: [T, H, latent_dim + rope_dim], kv_cache: [num_pages, page_size, latent_dim + rope_dim]
        -> [T, H, latent_dim] in q's dtype. Padded batched matmuls (engine/attention/torch_decode.py); the
        step's layout is built by the first layer that sees `attn` and reused by the others."""
        heads = q.shape[1]
        cached = self._layout
        if cached is None or cached[0] is not attn or cached[1] != heads:
            cached = (attn, heads, build_decode_layout(attn, heads, _SCORE_BUDGET))
            self._layout = cached
        return decode_attention(q, kv_cache, cached[2], softmax_scale, latent_dim)


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
        q_rows = host_to_device([q_starts[i] + min(j, q_lens[i] - 1) for i in group for j in range(q_max)],
                                torch.int64, device)
        k_rows = host_to_device([k_starts[i] + min(j, k_lens[i] - 1) for i in group for j in range(k_max)],
                                torch.int64, device)
        queries = q.index_select(0, q_rows).view(len(group), q_max, heads, -1).float().transpose(1, 2)
        keys = k.index_select(0, k_rows).view(len(group), k_max, heads, -1).float().permute(0, 2, 3, 1)
        values = v.index_select(0, k_rows).view(len(group), k_max, heads, -1).float().transpose(1, 2)
        scores = torch.matmul(queries, keys).mul_(scale)  # [S, H, Q, K]
        q_len_t = host_to_device([q_lens[i] for i in group], torch.int64, device).view(-1, 1, 1)
        k_len_t = host_to_device([k_lens[i] for i in group], torch.int64, device).view(-1, 1, 1)
        visible = torch.arange(k_max, device=device).view(1, 1, -1) <= (
            k_len_t - q_len_t + torch.arange(q_max, device=device).view(1, -1, 1)
        )
        scores.masked_fill_(~visible.unsqueeze(1), float("-inf"))
        result = torch.matmul(torch.softmax(scores, dim=-1), values).transpose(1, 2)  # [S, Q, H, Dv]
        for index, i in enumerate(group):
            out[q_starts[i] : q_starts[i] + q_lens[i]] = result[index, : q_lens[i]].to(out.dtype)
