"""Reference attention in plain PyTorch: varlen MHA-form prefill and absorbed decode over the paged cache.

Correctness first: every sequence is computed separately, scores and softmax in float32, causal
mask aligned bottom-right. Every other backend is tested against this one.
"""
from __future__ import annotations

import torch

from engine.attention.base import AttentionBackend
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

    def prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        q_lens: tuple[int, ...],
        k_lens: tuple[int, ...],
        softmax_scale: float,
    ) -> torch.Tensor:
        """q: [Tq, H, Dqk], k: [Tk, H, Dqk], v: [Tk, H, Dv] -> [Tq, H, Dv] in q's dtype."""
        out = torch.empty(q.shape[0], q.shape[1], v.shape[-1], dtype=q.dtype, device=q.device)
        q_start = k_start = 0
        for q_len, k_len in zip(q_lens, k_lens):
            if k_len < q_len:
                raise ValueError(f"prefill needs k_len >= q_len, got {k_len} < {q_len}")
            out[q_start : q_start + q_len] = _causal_attention(
                q[q_start : q_start + q_len], k[k_start : k_start + k_len], v[k_start : k_start + k_len], softmax_scale
            ).to(q.dtype)
            q_start += q_len
            k_start += k_len
        return out

    def decode(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        attn: AttentionMetadata,
        softmax_scale: float,
        latent_dim: int,
    ) -> torch.Tensor:
        """q: [T, H, latent_dim + rope_dim], kv_cache: [num_pages, page_size, latent_dim + rope_dim]
        -> [T, H, latent_dim] in q's dtype."""
        out = torch.empty(q.shape[0], q.shape[1], latent_dim, dtype=q.dtype, device=q.device)
        start = 0
        for i, (q_len, kv_len) in enumerate(zip(attn.q_lens_cpu, attn.kv_lens_cpu)):
            context = gather_context(kv_cache, attn.block_table[i], kv_len)  # [kv_len, D]
            out[start : start + q_len] = _causal_attention(
                q[start : start + q_len], context, context[:, :latent_dim], softmax_scale
            ).to(q.dtype)
            start += q_len
        return out
