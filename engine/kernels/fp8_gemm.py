"""Block-scaled FP8 GEMM: y = x @ dequant(weight).T with the weight kept in FP8 (e4m3) on the device.

DeepSeek-V3's checkpoint layout: weight [N, K] float8_e4m3fn and weight_scale_inv [ceil(N/128), ceil(K/128)]
float32, dequant(weight)[n, k] = weight[n, k] * scale_inv[n // 128, k // 128]. Activations are either
bf16/fp32 (the weight tile is dequantised to the activation dtype inside the K loop) or quantised to FP8
per token and 128-wide K group (x_scale [M, ceil(K/128)]), in which case the FP8 x FP8 product of each K
tile is scaled by x_scale[m] * w_scale[n] before it is added to the fp32 accumulator. BLOCK_K divides the
quantisation block, so one K tile never straddles two scales.

engine.kernels.fp8_quant.fp8_gemm_reference is the torch oracle (dequantise, then an fp32 matmul);
fp8_block_gemm here is the Triton kernel (GPU, or CPU under TRITON_INTERPRET=1); engine.layers.fp8_linear
picks between them and torch._scaled_mm.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels import dot_precision
from engine.kernels.fp8_quant import check_fp8_gemm_shapes, quantize_per_token_group


@triton.jit
def fp8_block_gemm_kernel(
    a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, c_ptr, M, N, K,
    stride_am, stride_ak, stride_asm, stride_ask, stride_bn, stride_bk, stride_bsn, stride_bsk,
    stride_cm, stride_cn,
    QUANT_N: tl.constexpr, QUANT_K: tl.constexpr, ACT_FP8: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """c[m, n] = sum_k a[m, k] * b[n, k] * b_scale[n // QUANT_N, k // QUANT_K] (* a_scale[m, k // QUANT_K])."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok, n_ok = offs_m < M, offs_n < N
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None] * stride_bk
    b_scale_ptrs = b_scale_ptr + (offs_n // QUANT_N) * stride_bsn
    a_scale_ptrs = a_scale_ptr + offs_m * stride_asm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        k_ok = offs_k + k_start < K
        a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        group = k_start // QUANT_K
        b_scale = tl.load(b_scale_ptrs + group * stride_bsk, mask=n_ok, other=0.0)
        if ACT_FP8:
            a_scale = tl.load(a_scale_ptrs + group * stride_ask, mask=m_ok, other=0.0)
            acc += tl.dot(a, b, out_dtype=tl.float32) * a_scale[:, None] * b_scale[None, :]
        else:
            b_dequant = (b.to(tl.float32) * b_scale[None, :]).to(a.dtype)
            acc += tl.dot(a, b_dequant, out_dtype=tl.float32, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def fp8_block_gemm(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                   block: tuple[int, int] = (128, 128), act_fp8: bool = False, block_m: int = 32,
                   block_n: int = 64, block_k: int | None = None) -> torch.Tensor:
    """The Triton kernel with fp8_gemm_reference's contract. block_k (default min(bk, 128)) must divide bk."""
    check_fp8_gemm_shapes(x, weight, scale_inv, block)
    block_k = block_k or min(block[1], 128)
    if block[1] % block_k or block_k < 16:
        raise ValueError(f"fp8 GEMM: BLOCK_K {block_k} must be >= 16 and divide the quantisation block {block[1]}")
    flat = x.reshape(-1, x.shape[-1])
    if act_fp8:
        a, a_scale = quantize_per_token_group(flat, block[1])
    else:
        a, a_scale = flat, scale_inv  # a_scale unused (ACT_FP8 false)
    rows, cols = flat.shape[0], weight.shape[0]
    out = torch.empty(rows, cols, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(rows, block_m), triton.cdiv(cols, block_n))
    fp8_block_gemm_kernel[grid](
        a, a_scale, weight, scale_inv, out, rows, cols, flat.shape[1],
        a.stride(0), a.stride(1), a_scale.stride(0), a_scale.stride(1), weight.stride(0), weight.stride(1),
        scale_inv.stride(0), scale_inv.stride(1), out.stride(0), out.stride(1),
        QUANT_N=block[0], QUANT_K=block[1], ACT_FP8=act_fp8, PRECISION=dot_precision(a.dtype),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )
    return out.view(*x.shape[:-1], cols)
