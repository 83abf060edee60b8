"""The one table of what AITER's attention kernels run (facts from ROCm/aiter's source): head counts per
kernel, the dtypes they take and the page sizes of the MLA decode kernel. Used by the AITER backend (which
pads heads and refuses dtypes by it) and by `pdserve plan` (which reports the padding a deployment needs).
Pure data and arithmetic: no torch, so the planner stays light.

- mla_decode_fwd (absorbed decode + speculative verify): non-persistent kernels for 8, 16, 32, 64 and 128
  heads, so 12 heads per rank pad to 16, 48 to 64, 96 to 128; q / kv in bf16 or fp8; the kernel takes
  log2 of the page size, so pages hold a power of two of tokens (older AITER without a page_size argument:
  pages of one token, which any cache can be viewed as).
- mla_prefill_fwd (absorbed prefill): 16 or 128 heads.
- the fp8 persistent MHA prefill: 1, 2, 4, 8, 10, 16, 32, 40, 48, 64, 96, 128 heads.
- flash_attn_varlen_func (bf16 MHA prefill): any head count.
fp32 is refused by every AITER kernel (the Triton / torch backends run it).
"""
from __future__ import annotations

from dataclasses import dataclass

AITER_DTYPES = ("bfloat16", "float8_e4m3fn", "float8_e4m3fnuz")


@dataclass(frozen=True)
class HeadKernel:
    """A kernel's support: `allowed` lists the exact head counts it runs (None: any count of at least
    `minimum`); fewer heads are zero-padded up to the next supported count. dtypes: torch dtype names."""

    name: str
    role: str
    allowed: tuple[int, ...] | None = None
    minimum: int = 1
    dtypes: tuple[str, ...] = AITER_DTYPES

    def __post_init__(self) -> None:
        if self.allowed is not None and tuple(sorted(self.allowed)) != self.allowed:
            raise ValueError(f"{self.name}: allowed head counts must be ascending, got {self.allowed}")
        if self.minimum < 1:
            raise ValueError(f"{self.name}: minimum must be positive, got {self.minimum}")

    def padded(self, heads: int) -> int | None:
        """The head count this kernel runs for `heads` real heads; None when no supported count fits."""
        if heads < 1:
            raise ValueError(f"heads must be positive, got {heads}")
        if self.allowed is None:
            return max(heads, self.minimum)
        return next((count for count in self.allowed if count >= heads), None)

    def supports(self, heads: int) -> bool:
        return self.padded(heads) == heads

    def supported(self) -> str:
        if self.allowed is None:
            return "any" if self.minimum <= 1 else f">= {self.minimum}"
        return "{" + ",".join(str(count) for count in self.allowed) + "}"


MLA_DECODE = HeadKernel("aiter.mla_decode_fwd", "decode + spec verify (absorbed), power-of-two page sizes",
                        allowed=(8, 16, 32, 64, 128))
MLA_PREFILL = HeadKernel("aiter.mla_prefill_fwd", "absorbed prefill", allowed=(16, 128))
FP8_MHA_PREFILL = HeadKernel("aiter.mla_prefill_ps_fwd", "fp8 persistent MHA prefill",
                             allowed=(1, 2, 4, 8, 10, 16, 32, 40, 48, 64, 96, 128),
                             dtypes=("float8_e4m3fn", "float8_e4m3fnuz"))
FLASH_ATTN_VARLEN = HeadKernel("aiter.flash_attn_varlen_func", "bf16 MHA prefill", dtypes=("bfloat16", "float16"))
FALLBACK = HeadKernel("triton / torch", "prefill + decode (fallback)", dtypes=("float32", "bfloat16", "float16"))
KERNELS = (MLA_DECODE, MLA_PREFILL, FP8_MHA_PREFILL, FLASH_ATTN_VARLEN, FALLBACK)


def mla_decode_page_size_supported(page_size: int) -> bool:
    """mla_decode_fwd's page-level indexing wants a power-of-two page size (it shifts by log2 of it)."""
    return page_size >= 1 and page_size & (page_size - 1) == 0


def check_aiter_dtype(kernel: HeadKernel, dtype_name: str) -> None:
    """Raises ValueError naming the dtype when `kernel` does not take it (e.g. float32 on any AITER kernel)."""
    if dtype_name not in kernel.dtypes:
        raise ValueError(f"{kernel.name} does not run {dtype_name} (it takes {', '.join(kernel.dtypes)}); "
                         "use dtype bfloat16 or the triton / torch attention backend")
