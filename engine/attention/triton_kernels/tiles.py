"""The tile choices and block sizes both attention kernels share (prefill.py, decode.py)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton


def split_head_dim(dim: int) -> tuple[int, int]:
    """Covers `dim` with two power-of-two blocks (tl.arange needs powers of two, tl.dot >= 16):
    192 -> (128, 64), 48 -> (32, 16), 40 -> (32, 16) masked, 64 -> (64, 0), 8 -> (16, 0) masked."""
    if dim < 1:
        raise ValueError(f"head dim must be positive, got {dim}")
    first = max(16, 1 << (dim.bit_length() - 1))
    rest = dim - first
    return first, (max(16, triton.next_power_of_2(rest)) if rest > 0 else 0)


@dataclass(frozen=True)
class Tiles:
    """The tile choices both attention kernels share. head_block: heads per program (a power of two >= 16,
    the tensor-core tile rows; the head count must be a multiple of it); block_n: keys per inner step (None:
    16 on CPU, 32 on a GPU); upcast: cast to float32 before every dot, exact (None: for float32 inputs and
    in the CPU interpreter, whose tl.dot on bf16 is wrong); False: bf16/fp16 dots, float32 accumulation."""

    head_block: int = 16
    block_n: int | None = None
    upcast: bool | None = None

    def __post_init__(self) -> None:
        if self.head_block < 16 or self.head_block & (self.head_block - 1):
            raise ValueError(f"head_block must be a power of two >= 16 (tensor-core tile rows), got {self.head_block}")

    def for_query(self, q: torch.Tensor) -> tuple[bool, int]:
        """(upcast, block_n) for q: [T, H, D], the defaults filled in; ValueError unless H is a multiple
        of head_block."""
        if q.shape[1] % self.head_block:
            raise ValueError(f"{q.shape[1]} heads is not a multiple of {self.head_block}; wrap with HeadPaddedBackend")
        on_cpu = q.device.type == "cpu"
        upcast = self.upcast if self.upcast is not None else on_cpu or q.dtype == torch.float32
        return upcast, self.block_n or (16 if on_cpu else 32)


def block_for(dim: int) -> int:
    """One power-of-two block >= max(dim, 16)."""
    return max(16, triton.next_power_of_2(dim))
