"""Attention heads per TP rank and the zero-padding each attention kernel needs, read from the engine's
one head-count table (engine.attention.head_table, facts from AITER's source)."""
from __future__ import annotations

from dataclasses import dataclass

from engine.attention.head_table import KERNELS, MLA_DECODE


@dataclass(frozen=True)
class KernelHeads:
    name: str
    role: str
    supported: str
    runs_heads: int | None  # None: this head count cannot run on the kernel
    padded: bool
    dtypes: tuple[str, ...] = ()  # the torch dtypes it takes (AITER: never float32)


@dataclass(frozen=True)
class HeadPlan:
    """heads_per_rank = heads / tp_size; padded_heads is what the AITER MLA decode kernel runs (None: more
    heads per rank than it has a kernel for, so decode runs on the triton / torch backend)."""

    heads: int
    tp_size: int
    heads_per_rank: int
    padded_heads: int | None
    padding_applies: bool
    kernels: tuple[KernelHeads, ...]

    @property
    def padding_overhead(self) -> float:
        """Extra attention compute from padding, e.g. 12 -> 16 heads: 0.333 (0 when the kernel cannot run it)."""
        return 0.0 if self.padded_heads is None else self.padded_heads / self.heads_per_rank - 1


def plan_heads(heads: int, tp_size: int) -> HeadPlan:
    if heads <= 0 or tp_size <= 0:
        raise ValueError(f"heads and TP size must be positive, got {heads} and {tp_size}")
    if heads % tp_size:
        raise ValueError(f"TP size {tp_size} does not divide the model's {heads} attention heads")
    per_rank = heads // tp_size
    kernels = []
    for kernel in KERNELS:
        runs = kernel.padded(per_rank)
        kernels.append(KernelHeads(kernel.name, kernel.role, kernel.supported(), runs,
                                   runs is not None and runs != per_rank, kernel.dtypes))
    padded = MLA_DECODE.padded(per_rank)
    return HeadPlan(heads, tp_size, per_rank, padded, padded is not None and padded != per_rank, tuple(kernels))
