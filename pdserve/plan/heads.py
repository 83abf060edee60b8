"""Attention heads per TP rank and the zero-padding each attention kernel needs (facts from AITER's source)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HeadKernel:
    """A kernel's head-count support: `allowed` lists the exact counts it runs (None: any count of at
    least `minimum`). Fewer heads are zero-padded up to the next supported count."""

    name: str
    role: str
    allowed: tuple[int, ...] | None = None
    minimum: int = 1

    def padded(self, heads: int) -> int | None:
        """The head count this kernel runs for `heads` real heads; None when no supported count fits."""
        if self.allowed is None:
            return max(heads, self.minimum)
        return next((count for count in sorted(self.allowed) if count >= heads), None)

    def supported(self) -> str:
        if self.allowed is None:
            return "any" if self.minimum <= 1 else f">= {self.minimum}"
        return "{" + ",".join(str(count) for count in self.allowed) + "}"


DECODE_KERNEL = HeadKernel("aiter.mla_decode_fwd", "decode + spec verify (absorbed)", minimum=16)
KERNELS = (
    DECODE_KERNEL,
    HeadKernel("aiter.mla_prefill_fwd", "absorbed prefill", allowed=(16, 128)),
    HeadKernel("aiter.mla_prefill_ps_fwd", "fp8 persistent MHA prefill",
               allowed=(1, 2, 4, 8, 10, 16, 32, 40, 48, 64, 96, 128)),
    HeadKernel("aiter.flash_attn_varlen_func", "bf16 MHA prefill"),
    HeadKernel("triton / torch", "prefill + decode (fallback)"),
)


@dataclass(frozen=True)
class KernelHeads:
    name: str
    role: str
    supported: str
    runs_heads: int | None  # None: this head count cannot run on the kernel
    padded: bool


@dataclass(frozen=True)
class HeadPlan:
    """heads_per_rank = heads / tp_size; padded_heads is what the AITER MLA decode kernel runs."""

    heads: int
    tp_size: int
    heads_per_rank: int
    padded_heads: int
    padding_applies: bool
    kernels: tuple[KernelHeads, ...]

    @property
    def padding_overhead(self) -> float:
        """Extra attention compute from padding, e.g. 12 -> 16 heads: 0.333."""
        return self.padded_heads / self.heads_per_rank - 1


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
                                   runs is not None and runs != per_rank))
    padded = DECODE_KERNEL.padded(per_rank)
    assert padded is not None  # the decode kernel accepts any count >= its minimum
    return HeadPlan(heads, tp_size, per_rank, padded, padded != per_rank, tuple(kernels))
