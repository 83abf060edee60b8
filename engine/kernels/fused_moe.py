"""Fused routed-experts MoE in Triton: a grouped GEMM over the active experts only.

Assignments are sorted by expert and padded per expert to BLOCK_M rows (moe_align.align_by_expert), so
every row block of the grouped GEMM belongs to one expert. Two launches:
  1. gate/up + SiLU: rows gather x[token], multiply by gate_up[e] (both halves in one program, two fp32
     accumulators) and store silu(gate) * up -> intermediate [T*k, I]
  2. down: rows read intermediate[slot], multiply by down[e], scale by the routing weight -> [T*k, H] fp32
then the k slots of each token are summed. Expert weights may be FP8 with 128x128 block scales (DeepSeek-V3's
checkpoint format, kept FP8 on the GPU): each weight tile is dequantised to the activation dtype inside
the K loop (BLOCK_K divides the quantisation block). Accumulation is always fp32 (tl.dot on bf16 inputs is wrong
in the interpreter, and fp32 accumulation is what the torch reference does). Runs on CUDA / ROCm; on
CPU only under TRITON_INTERPRET=1 (tests). Same contract as engine.kernels.moe_torch.moe_grouped.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels import dot_precision
from engine.kernels.moe_align import AlignedRouting, align_by_expert


@triton.jit
def grouped_gemm_kernel(
    a_ptr, b_ptr, c_ptr, sorted_ids_ptr, block_expert_ptr, num_padded_ptr, weight_ptr, b_scale_ptr,
    N, K, num_valid, a_row_divisor,
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn, gate_offset,
    stride_se, stride_sn, stride_sk,
    GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr, B_SCALED: tl.constexpr, QUANT_N: tl.constexpr,
    QUANT_K: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """c[slot, n] = (a[slot // a_row_divisor] @ b[expert].T)[n] for the BLOCK_M slots of one row block.

    GATED: b rows n and n + gate_offset are gate and up; c = silu(gate) * up. MUL_WEIGHT: c *= weight[slot].
    B_SCALED: b is FP8, b[e, n, k] * b_scale[e, n // QUANT_N, k // QUANT_K] is the weight."""
    num_n_blocks = tl.cdiv(N, BLOCK_N)
    block_m = tl.program_id(0) // num_n_blocks
    block_n = tl.program_id(0) % num_n_blocks
    if block_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_expert_ptr + block_m).to(tl.int64)
    offs_m = block_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(sorted_ids_ptr + offs_m)
    row_ok = slots < num_valid
    a_rows = (slots // a_row_divisor).to(tl.int64)
    offs_n = block_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + expert * stride_be + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None] * stride_bk
    scale_ptrs = b_scale_ptr + expert * stride_se + (offs_n // QUANT_N) * stride_sn
    up_scale_ptrs = b_scale_ptr + expert * stride_se + ((offs_n + gate_offset) // QUANT_N) * stride_sn
    n_ok = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        k_ok = offs_k + k_start < K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if B_SCALED:
            scale = tl.load(scale_ptrs + (k_start // QUANT_K) * stride_sk, mask=n_ok, other=0.0)
            b = (b.to(tl.float32) * scale[None, :]).to(a.dtype)
        acc += tl.dot(a, b, out_dtype=tl.float32, input_precision=PRECISION)
        if GATED:
            b_up = tl.load(b_ptrs + gate_offset * stride_bn, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if B_SCALED:
                up_scale = tl.load(up_scale_ptrs + (k_start // QUANT_K) * stride_sk, mask=n_ok, other=0.0)
                b_up = (b_up.to(tl.float32) * up_scale[None, :]).to(a.dtype)
            acc_up += tl.dot(a, b_up, out_dtype=tl.float32, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if GATED:
        acc = acc * tl.sigmoid(acc) * acc_up
    if MUL_WEIGHT:
        acc = acc * tl.load(weight_ptr + slots, mask=row_ok, other=0.0)[:, None]
    c_ptrs = c_ptr + slots.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_n[None, :] < N))


def choose_block_m(num_assignments: int, num_experts: int) -> int:
    """16 rows (the smallest tl.dot tile) while experts get few tokens each, 64 once they get many."""
    return 16 if num_assignments <= 8 * num_experts else 64


def _launch(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, routing: AlignedRouting, weights: torch.Tensor | None,
            a_row_divisor: int, gated: bool, block_n: int, block_k: int, scale: torch.Tensor | None,
            quant_block: tuple[int, int]) -> None:
    n = b.shape[1] // 2 if gated else b.shape[1]
    grid = (routing.block_expert.shape[0] * triton.cdiv(n, block_n),)
    scales = c if scale is None else scale
    grouped_gemm_kernel[grid](
        a, b, c, routing.sorted_ids, routing.block_expert, routing.num_padded, c if weights is None else weights,
        scales, n, a.shape[1], c.shape[0], a_row_divisor,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1), n,
        scales.stride(0), scales.stride(1), scales.stride(-1),
        GATED=gated, MUL_WEIGHT=weights is not None, B_SCALED=scale is not None, QUANT_N=quant_block[0],
        QUANT_K=quant_block[1], PRECISION=dot_precision(a.dtype), BLOCK_M=routing.block_m, BLOCK_N=block_n,
        BLOCK_K=block_k,
    )


def _check_scales(name: str, weight: torch.Tensor, scale: torch.Tensor | None, block: tuple[int, int]) -> None:
    if scale is None:
        return
    experts, rows, cols = weight.shape
    expected = (experts, -(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale.shape) != expected:
        raise ValueError(f"fused_moe: {name} scale {tuple(scale.shape)} should be {expected} for {tuple(weight.shape)}")


def fused_moe(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
              local_ids: torch.Tensor, block_m: int | None = None, block_n: int = 64, block_k: int = 64,
              gate_up_scale: torch.Tensor | None = None, down_scale: torch.Tensor | None = None,
              quant_block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """x [T, H], gate_up [E, 2I, H], down [E, H, I], weights [T, k] float32, local_ids [T, k] -> [T, H] float32.

    Slots whose local id is outside [0, E) (experts on other ranks) contribute zero. FP8 experts:
    gate_up_scale [E, ceil(2I/bn), ceil(H/bk)] and down_scale [E, ceil(H/bn), ceil(I/bk)] (the gate and up
    halves must not share a scale block: I a multiple of bn)."""
    num_tokens, top_k = local_ids.shape
    num_experts, two_inter, hidden = gate_up.shape
    if down.shape != (num_experts, hidden, two_inter // 2) or x.shape != (num_tokens, hidden):
        raise ValueError(f"fused_moe: shapes x {tuple(x.shape)}, gate_up {tuple(gate_up.shape)}, "
                         f"down {tuple(down.shape)} do not agree")
    _check_scales("gate_up", gate_up, gate_up_scale, quant_block)
    _check_scales("down", down, down_scale, quant_block)
    if gate_up_scale is not None or down_scale is not None:
        if (two_inter // 2) % quant_block[0]:
            raise ValueError(f"fused_moe: FP8 gate/up halves of {two_inter // 2} rows straddle a "
                             f"{quant_block[0]}-row scale block")
        block_k = min(block_k, quant_block[1])
        if quant_block[1] % block_k:
            raise ValueError(f"fused_moe: BLOCK_K {block_k} must divide the quantisation block {quant_block[1]}")
    num_slots = num_tokens * top_k
    routing = align_by_expert(local_ids, num_experts, block_m or choose_block_m(num_slots, num_experts))
    intermediate = torch.empty(num_slots, two_inter // 2, dtype=x.dtype, device=x.device)
    _launch(x, gate_up, intermediate, routing, None, top_k, True, block_n, block_k, gate_up_scale, quant_block)
    per_slot = torch.zeros(num_slots, hidden, dtype=torch.float32, device=x.device)
    flat_weights = weights.reshape(-1).float().contiguous()
    _launch(intermediate, down, per_slot, routing, flat_weights, 1, False, block_n, block_k, down_scale, quant_block)
    return per_slot.view(num_tokens, top_k, hidden).sum(dim=1)
