"""Our own Triton attention kernels: varlen flash prefill (MHA form) and paged latent decode (absorbed form).

The kernels run on CUDA and ROCm GPUs, and on CPU under the Triton interpreter. Triton decides
interpreter vs compiler when a kernel is decorated (`@triton.jit` reads TRITON_INTERPRET at that
moment), so TRITON_INTERPRET=1 must be set before the modules here are first imported;
`kernels_interpreted()` tells which mode they were built in.
"""
from __future__ import annotations

import torch
import triton


def kernels_interpreted() -> bool:
    """True when this package's kernels were decorated in interpreter mode (CPU tensors)."""
    from engine.attention.triton_kernels import decode, prefill

    return not isinstance(prefill.flash_prefill_kernel, triton.runtime.JITFunction) and not isinstance(
        decode.paged_decode_kernel, triton.runtime.JITFunction
    )


def split_head_dim(dim: int) -> tuple[int, int]:
    """Covers `dim` with two power-of-two blocks (tl.arange needs powers of two, tl.dot >= 16):
    192 -> (128, 64), 48 -> (32, 16), 40 -> (32, 16) masked, 64 -> (64, 0), 8 -> (16, 0) masked."""
    if dim < 1:
        raise ValueError(f"head dim must be positive, got {dim}")
    first = max(16, 1 << (dim.bit_length() - 1))
    rest = dim - first
    return first, (max(16, triton.next_power_of_2(rest)) if rest > 0 else 0)


def launch_defaults(q: torch.Tensor, upcast: bool | None, block_n: int | None) -> tuple[bool, int]:
    """(upcast, block_n) where the caller left them None: upcast for float32 inputs and in the CPU
    interpreter (whose tl.dot on bf16 is wrong); key blocks of 16 on CPU, 32 on a GPU."""
    on_cpu = q.device.type == "cpu"
    if upcast is None:
        upcast = on_cpu or q.dtype == torch.float32
    return upcast, block_n or (16 if on_cpu else 32)


def block_for(dim: int) -> int:
    """One power-of-two block >= max(dim, 16)."""
    return max(16, triton.next_power_of_2(dim))
