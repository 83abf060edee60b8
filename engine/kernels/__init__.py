"""Non-attention compute kernels: the routed-experts MoE (torch grouped / dense paths and a Triton fused
kernel), the block-scaled FP8 GEMM and the MXFP4 expert GEMM. Every Triton kernel has a pure-torch reference here that is its
test oracle; the Triton modules are imported lazily by their callers so a missing triton never breaks
`import engine`."""
from __future__ import annotations

import torch


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot input_precision for these inputs: fp32 multiplies in full precision ("ieee": no TF32 rounding,
    fp32 runs are parity checks); bf16 / fp8 use the tensor cores as they are."""
    return "ieee" if dtype == torch.float32 else "tf32"
