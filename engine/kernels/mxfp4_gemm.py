"""Triton GEMM with MXFP4 weights dequantised in the K loop: out [M, N] = x [M, K] @ W^T, fp32 accumulate.

W is read as stored: packed [N, K/2] uint8 (low nibble = even column k, high nibble = odd column k+1)
and scale [N, K/32] uint8 (UE8M0). A program owns a BLOCK_M x BLOCK_N output tile; each K step loads
BLOCK_K/2 packed bytes per weight row, decodes the low nibbles against the even columns of x and the high
nibbles against the odd columns (two tl.dot per step, no interleave), each scaled by its group's 2^(s-127).
Inputs are upcast to float32 before tl.dot (the interpreter's bf16 tl.dot is wrong; on GPU this is the
plain correctness-first form - an MXFP8-activation variant is left for a GPU session).

Runs on CUDA / ROCm GPUs and on CPU under TRITON_INTERPRET=1 (set before triton is imported).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

GROUP_SIZE = 32


@triton.jit
def _decode_fp4(codes, scale):
    """codes: uint8 0..15, scale: float32 factor -> float32 E2M1 value * scale."""
    exponent = ((codes >> 1) & 3).to(tl.float32)
    mantissa = (codes & 1).to(tl.float32)
    normal = tl.exp2(exponent - 1.0) * (1.0 + 0.5 * mantissa)
    magnitude = tl.where(exponent == 0.0, 0.5 * mantissa, normal)
    value = tl.where((codes & 8) != 0, -magnitude, magnitude)
    return value * scale


@triton.jit
def mxfp4_gemm_kernel(
    x_ptr, packed_ptr, scale_ptr, out_ptr, M, N, K,
    stride_xm, stride_xk, stride_pn, stride_pk, stride_sn, stride_sk, stride_om, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_half = tl.arange(0, BLOCK_K // 2)  # byte index within the K step: columns 2j and 2j + 1
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + 2 * offs_half
        col_ok = cols < K
        x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
        x_mask = (offs_m[:, None] < M) & col_ok[None, :]
        x_even = tl.load(x_rows + cols[None, :] * stride_xk, mask=x_mask, other=0.0).to(tl.float32)
        x_odd = tl.load(x_rows + (cols[None, :] + 1) * stride_xk, mask=x_mask, other=0.0).to(tl.float32)
        w_mask = (offs_n[:, None] < N) & col_ok[None, :]
        byte_idx = k0 // 2 + offs_half
        packed = tl.load(packed_ptr + offs_n[:, None].to(tl.int64) * stride_pn + byte_idx[None, :] * stride_pk,
                         mask=w_mask, other=0)
        group = cols // GROUP
        exps = tl.load(scale_ptr + offs_n[:, None].to(tl.int64) * stride_sn + group[None, :] * stride_sk,
                       mask=w_mask, other=127)
        factor = tl.exp2(exps.to(tl.float32) - 127.0)
        w_even = _decode_fp4(packed & 15, factor)  # [BLOCK_N, BLOCK_K/2]
        w_odd = _decode_fp4(packed >> 4, factor)
        acc += tl.dot(x_even, tl.trans(w_even), input_precision="ieee")
        acc += tl.dot(x_odd, tl.trans(w_odd), input_precision="ieee")
    out_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :] * stride_on, acc, mask=out_mask)


def mxfp4_gemm(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
    block_m: int = 16, block_n: int = 32, block_k: int = 64,
) -> torch.Tensor:
    """x [M, K] (any float dtype), packed [N, K/2] uint8, scale [N, K/32] uint8 -> [M, N] float32."""
    if x.dim() != 2 or packed.dim() != 2 or scale.dim() != 2:
        raise ValueError("mxfp4_gemm takes 2-D x, packed and scale")
    m, k = x.shape
    n = packed.shape[0]
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise ValueError(f"packed/scale must be uint8, got {packed.dtype}/{scale.dtype}")
    if k % GROUP_SIZE or packed.shape[1] * 2 != k or tuple(scale.shape) != (n, k // GROUP_SIZE):
        raise ValueError(f"shapes disagree: x {tuple(x.shape)}, packed {tuple(packed.shape)}, scale {tuple(scale.shape)}")
    if block_k % (2 * 16) or block_k < GROUP_SIZE:
        raise ValueError(f"block_k must be a multiple of 32, got {block_k}")
    out = torch.empty(m, n, dtype=torch.float32, device=x.device)
    if m == 0:
        return out
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    mxfp4_gemm_kernel[grid](
        x, packed, scale, out, m, n, k,
        x.stride(0), x.stride(1), packed.stride(0), packed.stride(1), scale.stride(0), scale.stride(1),
        out.stride(0), out.stride(1),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP=GROUP_SIZE,
    )
    return out
