"""Varlen causal flash-attention prefill (MHA form: q/k head dim may differ from v's), one head per program.

One program owns BLOCK_M query rows of one sequence and one head (grid: sequences x query blocks x heads,
so a 2,048-token chunk of 16 heads is 512 programs, enough for every SM): online softmax over key
blocks, scores and accumulators in float32, the causal mask aligned bottom-right (query row i of a
sequence with q_len queries and k_len keys sees keys 0 .. k_len - q_len + i). The q/k head dim is
covered by one or two power-of-two blocks (192 = 128 + 64; 32 = 32 + none: the second block's
offsets are built only when BLOCK_D2 > 0, as tl.arange(0, 0) does not compile) and every dim is
masked, so non-power-of-two dims work.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.attention.triton_kernels.tiles import Tiles, block_for, split_head_dim
from engine.attention.triton_kernels.online_softmax import (
    load_query, online_softmax_step, score_dot, softmax_start,
)

LOG2E = 1.4426950408889634


@triton.jit
def flash_prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, cu_q_ptr, cu_k_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    qk_scale,
    DQK: tl.constexpr, DV: tl.constexpr, BLOCK_D1: tl.constexpr, BLOCK_D2: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr,
):
    seq = tl.program_id(0)
    m_block = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    if m_block * BLOCK_M >= q_len:
        return
    k_start = tl.load(cu_k_ptr + seq)
    k_len = tl.load(cu_k_ptr + seq + 1) - k_start

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d1 = tl.arange(0, BLOCK_D1)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_valid = offs_m < q_len
    last_key = k_len - q_len + offs_m  # bottom-right causal: last visible key per query row
    key_end = tl.minimum(k_len, k_len - q_len + (m_block + 1) * BLOCK_M)
    q_rows = (q_start + offs_m).to(tl.int64) * stride_qt
    o_rows = (q_start + offs_m).to(tl.int64) * stride_ot

    q_base = q_ptr + q_rows[:, None] + head * stride_qh
    q1 = load_query(q_base + offs_d1[None, :], row_valid[:, None] & (offs_d1[None, :] < DQK), UPCAST)
    if BLOCK_D2 > 0:
        offs_d2 = BLOCK_D1 + tl.arange(0, BLOCK_D2)
        q2 = load_query(q_base + offs_d2[None, :], row_valid[:, None] & (offs_d2[None, :] < DQK), UPCAST)
    m_i, l_i, acc = softmax_start(BLOCK_M, BLOCK_DV)
    for start_n in range(0, key_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        key_valid = offs_n < k_len
        k_rows = (k_start + offs_n).to(tl.int64)
        k_base = k_ptr + k_rows[None, :] * stride_kt + head * stride_kh  # transposed: [D, BLOCK_N]
        k1 = tl.load(k_base + offs_d1[:, None], mask=key_valid[None, :] & (offs_d1[:, None] < DQK), other=0.0)
        scores = score_dot(q1, k1, UPCAST)
        if BLOCK_D2 > 0:
            k2 = tl.load(k_base + offs_d2[:, None], mask=key_valid[None, :] & (offs_d2[:, None] < DQK), other=0.0)
            scores += score_dot(q2, k2, UPCAST)
        visible = key_valid[None, :] & (offs_n[None, :] <= last_key[:, None])
        scores = tl.where(visible, scores * qk_scale, float("-inf"))
        v_base = v_ptr + k_rows[:, None] * stride_vt + head * stride_vh
        v = tl.load(v_base + offs_dv[None, :], mask=key_valid[:, None] & (offs_dv[None, :] < DV), other=0.0)
        m_i, l_i, acc = online_softmax_step(m_i, l_i, acc, scores, v, UPCAST)
    out = acc / l_i[:, None]
    o_base = out_ptr + o_rows[:, None] + head * stride_oh
    tl.store(o_base + offs_dv[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_valid[:, None] & (offs_dv[None, :] < DV))


def flash_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_q_len: int,
    softmax_scale: float,
    tiles: Tiles = Tiles(),
    block_m: int | None = None,
) -> torch.Tensor:
    """q: [Tq, H, Dqk], k: [Tk, H, Dqk], v: [Tk, H, Dv] (H a multiple of tiles.head_block, the padding the
    decode kernel needs; every head is its own program here; last dim contiguous), cu_seqlens_q / cu_seqlens_k: [num_seqs + 1] int32 -> [Tq, H, Dv] in q's dtype.
    block_m: query rows per program (default: 16 on CPU, 64 on a GPU)."""
    num_heads, dqk, dv = q.shape[1], q.shape[2], v.shape[2]
    upcast, block_n = tiles.for_query(q)
    if k.shape[1] != num_heads or v.shape[1] != num_heads or k.shape[2] != dqk:
        raise ValueError(f"shape mismatch q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)}")
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    block_m = block_m or (16 if q.device.type == "cpu" else 64)
    out = torch.empty(q.shape[0], num_heads, dv, dtype=q.dtype, device=q.device)
    num_seqs = cu_seqlens_q.numel() - 1
    if q.shape[0] == 0 or num_seqs == 0:
        return out
    block_d1, block_d2 = split_head_dim(dqk)
    grid = (num_seqs, triton.cdiv(max_q_len, block_m), num_heads)
    flash_prefill_kernel[grid](
        q, k, v, out, cu_seqlens_q.to(torch.int32), cu_seqlens_k.to(torch.int32),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        softmax_scale * LOG2E,
        DQK=dqk, DV=dv, BLOCK_D1=block_d1, BLOCK_D2=block_d2, BLOCK_DV=block_for(dv),
        BLOCK_M=block_m, BLOCK_N=block_n, UPCAST=upcast,
    )
    return out
