"""Paged latent attention for the absorbed MLA form (decode and speculative verification).

The cache holds one latent vector per token (latent_dim + rope_dim values), shared by every head:
keys are the whole vector, values its first latent_dim values. One program owns one query token of
one sequence and HEAD_BLOCK heads; the heads are the rows of every tl.dot (16 rows: the smallest
tensor-core tile), so a program reads each cached token once for all its heads. A sequence may bring
several query tokens; query j of q_len sees context positions 0 .. kv_len - q_len + j (bottom-right).
Token n of a sequence lives at page block_table[seq, n // page_size], slot n % page_size.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.attention.triton_kernels import block_for

LOG2E = 1.4426950408889634


@triton.jit
def paged_decode_kernel(
    q_ptr, cache_ptr, out_ptr, cu_q_ptr, kv_lens_ptr, block_table_ptr,
    stride_qt, stride_qh, stride_cp, stride_cs, stride_ot, stride_oh, stride_bt,
    qk_scale, page_size,
    LATENT: tl.constexpr, ROPE: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
    HEAD_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr,
):
    seq = tl.program_id(0)
    query = tl.program_id(1)
    head_group = tl.program_id(2)
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    if query >= q_len:
        return
    kv_len = tl.load(kv_lens_ptr + seq)
    visible_len = kv_len - q_len + query + 1

    offs_h = head_group * HEAD_BLOCK + tl.arange(0, HEAD_BLOCK)
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    q_base = q_ptr + (q_start + query).to(tl.int64) * stride_qt + offs_h[:, None] * stride_qh
    q_lat = tl.load(q_base + offs_l[None, :], mask=offs_l[None, :] < LATENT, other=0.0)
    if ROPE > 0:
        q_rope = tl.load(q_base + LATENT + offs_r[None, :], mask=offs_r[None, :] < ROPE, other=0.0)
    if UPCAST:
        q_lat = q_lat.to(tl.float32)
        if ROPE > 0:
            q_rope = q_rope.to(tl.float32)

    m_i = tl.full([HEAD_BLOCK], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([HEAD_BLOCK], dtype=tl.float32)
    acc = tl.zeros([HEAD_BLOCK, BLOCK_L], dtype=tl.float32)
    table_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    for start_n in range(0, visible_len, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        valid = offs_n < visible_len
        page = tl.load(table_row + offs_n // page_size, mask=valid, other=0)
        slot = page.to(tl.int64) * stride_cp + (offs_n % page_size).to(tl.int64) * stride_cs
        # keys transposed [D, BLOCK_N] for the score dots; the latent rows [BLOCK_N, L] are the values
        k_lat_t = tl.load(cache_ptr + slot[None, :] + offs_l[:, None],
                          mask=valid[None, :] & (offs_l[:, None] < LATENT), other=0.0)
        if UPCAST:
            scores = tl.dot(q_lat, k_lat_t.to(tl.float32), input_precision="ieee")
        else:
            scores = tl.dot(q_lat, k_lat_t)
        if ROPE > 0:
            k_rope_t = tl.load(cache_ptr + slot[None, :] + LATENT + offs_r[:, None],
                               mask=valid[None, :] & (offs_r[:, None] < ROPE), other=0.0)
            if UPCAST:
                scores += tl.dot(q_rope, k_rope_t.to(tl.float32), input_precision="ieee")
            else:
                scores += tl.dot(q_rope, k_rope_t)
        scores = tl.where(valid[None, :], scores * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        values = tl.trans(k_lat_t)
        if UPCAST:
            acc = acc * alpha[:, None] + tl.dot(p, values.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(values.dtype), values)
        m_i = m_new
    out = acc / l_i[:, None]
    o_base = out_ptr + (q_start + query).to(tl.int64) * stride_ot + offs_h[:, None] * stride_oh
    tl.store(o_base + offs_l[None, :], out.to(out_ptr.dtype.element_ty), mask=offs_l[None, :] < LATENT)


def paged_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    kv_lens: torch.Tensor,
    block_table: torch.Tensor,
    max_q_len: int,
    latent_dim: int,
    softmax_scale: float,
    head_block: int = 16,
    block_n: int | None = None,
    upcast: bool | None = None,
) -> torch.Tensor:
    """q: [T, H, latent_dim + rope_dim] (H a multiple of head_block), kv_cache: [num_pages, page_size,
    latent_dim + rope_dim], cu_seqlens_q: [num_seqs + 1], kv_lens: [num_seqs], block_table:
    [num_seqs, max_pages] -> [T, H, latent_dim] in q's dtype."""
    num_heads, entry_dim = q.shape[1], q.shape[2]
    if num_heads % head_block:
        raise ValueError(f"{num_heads} heads is not a multiple of {head_block}; wrap with HeadPaddedBackend")
    if kv_cache.dim() != 3 or kv_cache.shape[2] != entry_dim or not 0 < latent_dim <= entry_dim:
        raise ValueError(f"cache {tuple(kv_cache.shape)} does not match q {tuple(q.shape)} / latent {latent_dim}")
    if q.stride(-1) != 1:
        q = q.contiguous()
    if kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache's last dim must be contiguous")
    on_cpu = q.device.type == "cpu"
    if upcast is None:
        upcast = on_cpu or q.dtype == torch.float32
    block_n = block_n or (16 if on_cpu else 32)
    rope_dim = entry_dim - latent_dim
    out = torch.empty(q.shape[0], num_heads, latent_dim, dtype=q.dtype, device=q.device)
    num_seqs = cu_seqlens_q.numel() - 1
    if q.shape[0] == 0 or num_seqs == 0:
        return out
    table = block_table.to(torch.int32).contiguous()
    grid = (num_seqs, max_q_len, num_heads // head_block)
    paged_decode_kernel[grid](
        q, kv_cache, out, cu_seqlens_q.to(torch.int32), kv_lens.to(torch.int32), table,
        q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), out.stride(0), out.stride(1),
        table.stride(0), softmax_scale * LOG2E, kv_cache.shape[1],
        LATENT=latent_dim, ROPE=rope_dim, BLOCK_L=block_for(latent_dim),
        BLOCK_R=block_for(rope_dim) if rope_dim else 16, HEAD_BLOCK=head_block, BLOCK_N=block_n, UPCAST=upcast,
    )
    return out
