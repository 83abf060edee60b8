"""Paged latent attention for the absorbed MLA form (decode and speculative verification).

The cache holds one latent vector per token (latent_dim + rope_dim values), shared by every head:
keys are the whole vector, values its first latent_dim values. One program owns one query token of
one sequence, HEAD_BLOCK heads and one of NUM_SPLITS key ranges; the heads are the rows of every tl.dot
(16 rows: the smallest tensor-core tile), so a program reads each cached token once for all its heads.
With several splits (flash-decoding: a long context and few sequences would otherwise leave most of a
GPU idle) each program stores its normalised partial output and log-sum-exp, merged by combine_splits.
A sequence may bring
several query tokens; query j of q_len sees context positions 0 .. kv_len - q_len + j (bottom-right).
Token n of a sequence lives at page block_table[seq, n // page_size], slot n % page_size.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.attention.triton_kernels.tiles import Tiles, block_for
from engine.attention.triton_kernels.online_softmax import (
    load_query, online_softmax_step, score_dot, softmax_start,
)

LOG2E = 1.4426950408889634


@triton.jit
def paged_decode_kernel(
    q_ptr, cache_ptr, out_ptr, lse_ptr, cu_q_ptr, kv_lens_ptr, block_table_ptr,
    stride_qt, stride_qh, stride_cp, stride_cs, stride_ot, stride_oh, stride_os, stride_lt, stride_lh, stride_bt,
    qk_scale, page_size,
    LATENT: tl.constexpr, ROPE: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
    HEAD_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, UPCAST: tl.constexpr,
):
    seq = tl.program_id(0)
    query = tl.program_id(1)
    head_group = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    if query >= q_len:
        return
    kv_len = tl.load(kv_lens_ptr + seq)
    visible_len = kv_len - q_len + query + 1
    split_len = tl.cdiv(tl.cdiv(visible_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    split_start = split * split_len
    split_end = tl.minimum(visible_len, split_start + split_len)

    offs_h = head_group * HEAD_BLOCK + tl.arange(0, HEAD_BLOCK)
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    q_base = q_ptr + (q_start + query).to(tl.int64) * stride_qt + offs_h[:, None] * stride_qh
    q_lat = load_query(q_base + offs_l[None, :], offs_l[None, :] < LATENT, UPCAST)
    if ROPE > 0:
        q_rope = load_query(q_base + LATENT + offs_r[None, :], offs_r[None, :] < ROPE, UPCAST)

    m_i, l_i, acc = softmax_start(HEAD_BLOCK, BLOCK_L)
    table_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    for start_n in range(split_start, split_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        valid = offs_n < split_end
        page = tl.load(table_row + offs_n // page_size, mask=valid, other=0)
        slot = page.to(tl.int64) * stride_cp + (offs_n % page_size).to(tl.int64) * stride_cs
        # keys transposed [D, BLOCK_N] for the score dots; the latent rows [BLOCK_N, L] are the values
        k_lat_t = tl.load(cache_ptr + slot[None, :] + offs_l[:, None],
                          mask=valid[None, :] & (offs_l[:, None] < LATENT), other=0.0)
        scores = score_dot(q_lat, k_lat_t, UPCAST)
        if ROPE > 0:
            k_rope_t = tl.load(cache_ptr + slot[None, :] + LATENT + offs_r[:, None],
                               mask=valid[None, :] & (offs_r[:, None] < ROPE), other=0.0)
            scores += score_dot(q_rope, k_rope_t, UPCAST)
        scores = tl.where(valid[None, :], scores * qk_scale, float("-inf"))
        m_i, l_i, acc = online_softmax_step(m_i, l_i, acc, scores, tl.trans(k_lat_t), UPCAST)
    out = acc / tl.maximum(l_i, 1.0e-30)[:, None]  # an empty split (l_i == 0) stores zeros
    row = (q_start + query).to(tl.int64)
    o_base = out_ptr + row * stride_ot + offs_h[:, None] * stride_oh + split * stride_os
    tl.store(o_base + offs_l[None, :], out.to(out_ptr.dtype.element_ty), mask=offs_l[None, :] < LATENT)
    if NUM_SPLITS > 1:  # log2-domain log-sum-exp of this split, -inf when it saw no key
        lse = tl.where(l_i > 0.0, m_i + tl.math.log2(tl.maximum(l_i, 1.0e-30)), float("-inf"))
        tl.store(lse_ptr + row * stride_lt + offs_h * stride_lh + split, lse)


SPLIT_BUCKETS = (1, 2, 4, 8, 16, 32)  # NUM_SPLITS is a constexpr: one compiled variant per value used


def choose_num_splits(programs: int, max_kv_len: int, device: torch.device) -> int:
    """Split the context across programs (flash-decoding) until the GPU has ~2 programs per SM/CU,
    keeping at least 256 keys per split, rounded down to a power of two from SPLIT_BUCKETS (NUM_SPLITS is
    a compile-time constant: growing contexts compile at most len(SPLIT_BUCKETS) variants, not one per
    value). CPU (interpreter): 1."""
    if device.type == "cpu":
        return 1
    processors = torch.cuda.get_device_properties(device).multi_processor_count
    wanted = max(1, min(triton.cdiv(2 * processors, max(programs, 1)), triton.cdiv(max_kv_len, 256)))
    return max(bucket for bucket in SPLIT_BUCKETS if bucket <= wanted)


def combine_splits(partial: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """partial: [T, H, S, L] per-split normalised outputs, lse: [T, H, S] (log2 domain) -> [T, H, L] float32."""
    weights = torch.exp2(lse - lse.amax(dim=2, keepdim=True))
    return (partial * weights.unsqueeze(-1)).sum(dim=2) / weights.sum(dim=2).unsqueeze(-1)


def paged_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    kv_lens: torch.Tensor,
    block_table: torch.Tensor,
    max_q_len: int,
    max_kv_len: int,
    latent_dim: int,
    softmax_scale: float,
    tiles: Tiles = Tiles(),
    num_splits: int | None = None,
) -> torch.Tensor:
    """q: [T, H, latent_dim + rope_dim] (H a multiple of tiles.head_block), kv_cache: [num_pages, page_size,
    latent_dim + rope_dim], cu_seqlens_q: [num_seqs + 1], kv_lens: [num_seqs], block_table:
    [num_seqs, max_pages] -> [T, H, latent_dim] in q's dtype.

    num_splits > 1 splits every context into that many key ranges run by separate programs and merges
    them by log-sum-exp (default: choose_num_splits)."""
    num_heads, entry_dim = q.shape[1], q.shape[2]
    upcast, block_n = tiles.for_query(q)
    if kv_cache.dim() != 3 or kv_cache.shape[2] != entry_dim or not 0 < latent_dim <= entry_dim:
        raise ValueError(f"cache {tuple(kv_cache.shape)} does not match q {tuple(q.shape)} / latent {latent_dim}")
    if q.stride(-1) != 1:
        q = q.contiguous()
    if kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache's last dim must be contiguous")
    rope_dim = entry_dim - latent_dim
    num_seqs = cu_seqlens_q.numel() - 1
    head_groups = num_heads // tiles.head_block
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs * max_q_len * head_groups, max_kv_len, q.device)
    if q.shape[0] == 0 or num_seqs == 0:
        return torch.empty(q.shape[0], num_heads, latent_dim, dtype=q.dtype, device=q.device)
    if num_splits == 1:
        out = torch.empty(q.shape[0], num_heads, 1, latent_dim, dtype=q.dtype, device=q.device)
        lse = torch.empty(1, 1, 1, dtype=torch.float32, device=q.device)  # unused
    else:
        out = torch.empty(q.shape[0], num_heads, num_splits, latent_dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(q.shape[0], num_heads, num_splits, dtype=torch.float32, device=q.device)
    table = block_table.to(torch.int32).contiguous()
    grid = (num_seqs, max_q_len, head_groups * num_splits)
    paged_decode_kernel[grid](
        q, kv_cache, out, lse, cu_seqlens_q.to(torch.int32), kv_lens.to(torch.int32), table,
        q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), out.stride(0), out.stride(1),
        out.stride(2), lse.stride(0), lse.stride(1), table.stride(0), softmax_scale * LOG2E, kv_cache.shape[1],
        LATENT=latent_dim, ROPE=rope_dim, BLOCK_L=block_for(latent_dim),
        BLOCK_R=block_for(rope_dim) if rope_dim else 16, HEAD_BLOCK=tiles.head_block, BLOCK_N=block_n,
        NUM_SPLITS=num_splits, UPCAST=upcast,
    )
    if num_splits == 1:
        return out.squeeze(2)
    return combine_splits(out, lse).to(q.dtype)
