"""Non-attention compute kernels: the routed-experts MoE (torch grouped / dense paths and a Triton fused
kernel), the block-scaled FP8 GEMM and the MXFP4 expert GEMM. Every Triton kernel has a pure-torch reference here that is its
test oracle; the Triton modules are imported lazily by their callers so a missing triton never breaks
`import engine`."""
from __future__ import annotations

import torch


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot input_precision for these inputs: "ieee" always. For fp32 that is full precision (no TF32
    rounding: fp32 runs are parity checks); for bf16 / fp16 / fp8 the setting does not change the tensor-core
    instruction, and "tf32" is refused by Triton's HIP backend on every target but gfx942 (MI355X's gfx950
    failed to compile every MoE layer with it)."""
    return "ieee"
