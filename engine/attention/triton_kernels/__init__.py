"""Our own Triton attention kernels: varlen flash prefill (MHA form) and paged latent decode (absorbed form).

The kernels run on CUDA and ROCm GPUs, and on CPU under the Triton interpreter. Triton decides
interpreter vs compiler when a kernel is decorated (`@triton.jit` reads TRITON_INTERPRET at that
moment), so TRITON_INTERPRET=1 must be set before the modules here are first imported;
`kernels_interpreted()` tells which mode they were built in.
"""
from __future__ import annotations

import triton

from engine.attention.triton_kernels.tiles import Tiles, block_for, split_head_dim

__all__ = ["Tiles", "block_for", "kernels_interpreted", "split_head_dim"]


def kernels_interpreted() -> bool:
    """True when this package's kernels were decorated in interpreter mode (CPU tensors)."""
    from engine.attention.triton_kernels import decode, prefill

    return not isinstance(prefill.flash_prefill_kernel, triton.runtime.JITFunction) and not isinstance(
        decode.paged_decode_kernel, triton.runtime.JITFunction
    )
