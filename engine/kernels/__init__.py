"""Non-attention compute kernels: the routed-experts MoE (torch grouped / dense paths and a Triton fused
kernel) and the block-scaled FP8 GEMM. Every Triton kernel has a pure-torch reference here that is its
test oracle; the Triton modules are imported lazily by their callers so a missing triton never breaks
`import engine`."""
from __future__ import annotations
