"""Storage formats: bits per weight (with quantisation scales) and bytes per KV-cache element."""
from __future__ import annotations

from dataclasses import dataclass

SCALE_BITS = {"bf16": 16, "fp16": 16, "fp32": 32, "ue8m0": 8}
KV_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp8": 1, "fp32": 4}
WEIGHT_DTYPES = ("bf16", "fp16", "fp8", "int4", "mxfp4")
MXFP4_GROUP = 32  # OCP MXFP4: one UE8M0 (power-of-two) scale byte per 32 FP4 E2M1 values
FP8_BLOCK = 128 * 128  # DeepSeek-V3 / Kimi-K2 FP8: one fp32 scale (weight_scale_inv) per 128x128 block
UNQUANTISED_BITS = 16  # embedding, lm_head, router and norms stay bf16 in every shipped checkpoint


@dataclass(frozen=True)
class WeightFormat:
    """A weight storage format: value bits plus one scale of scale_bits per group_size weights.
    bits_per_weight = value_bits + scale_bits / group_size, e.g. int4 with a bf16 scale per
    32 weights: 4 + 16 / 32 = 4.5 bits."""

    name: str
    value_bits: int
    group_size: int = 0  # 0: no scales
    scale_bits: int = 0

    def __post_init__(self) -> None:
        if self.value_bits <= 0:
            raise ValueError(f"{self.name}: value bits must be positive, got {self.value_bits}")
        if self.group_size < 0 or self.scale_bits < 0:
            raise ValueError(f"{self.name}: group size and scale bits must be >= 0")
        if (self.group_size == 0) != (self.scale_bits == 0):
            raise ValueError(f"{self.name}: a group size needs scale bits and vice versa")

    @property
    def bits_per_weight(self) -> float:
        if self.group_size == 0:
            return float(self.value_bits)
        return self.value_bits + self.scale_bits / self.group_size

    def describe(self) -> str:
        if self.name == "int4":
            scale = {16: "16-bit", 32: "fp32"}.get(self.scale_bits, f"{self.scale_bits}-bit")
            return f"int4, group {self.group_size}, {scale} scales ({self.bits_per_weight:.2f} bits)"
        if self.name == "mxfp4":
            return f"mxfp4 (fp4 e2m1, a ue8m0 scale per {self.group_size}: {self.bits_per_weight:.2f} bits)"
        if self.name == "fp8":
            return f"fp8, 128x128 block scales ({self.bits_per_weight:.3f} bits)"
        return f"{self.name} ({self.bits_per_weight:g} bits)"


def weight_format(name: str, group_size: int = 32, scale_dtype: str = "bf16") -> WeightFormat:
    """bf16 | fp16 | fp8 (128x128 fp32 block scales) | int4 (a scale_dtype scale per group_size weights) |
    mxfp4 (4.25 bits: Kimi K3's routed experts)."""
    if name in ("bf16", "fp16"):
        return WeightFormat(name, 16)
    if name == "fp8":
        return WeightFormat("fp8", 8, FP8_BLOCK, 32)
    if name == "mxfp4":
        return WeightFormat("mxfp4", 4, MXFP4_GROUP, SCALE_BITS["ue8m0"])
    if name == "int4":
        if scale_dtype not in SCALE_BITS:
            raise ValueError(f"unknown scale dtype {scale_dtype!r} (known: {', '.join(SCALE_BITS)})")
        if group_size <= 0:
            raise ValueError(f"int4 group size must be positive, got {group_size}")
        return WeightFormat("int4", 4, group_size, SCALE_BITS[scale_dtype])
    raise ValueError(f"unknown weight dtype {name!r} (known: {', '.join(WEIGHT_DTYPES)})")


@dataclass(frozen=True)
class Quantization:
    """How a checkpoint stores its weights: `linear` for attention, dense MLPs and shared experts,
    `experts` for the routed experts (int4 experts + bf16 rest is how Kimi K2-Thinking ships, MXFP4 experts +
    bf16 rest Kimi K3).
    Embedding, lm_head, router and norms are UNQUANTISED_BITS wide."""

    linear: WeightFormat
    experts: WeightFormat

    def describe(self) -> str:
        if self.linear == self.experts:
            return self.linear.describe()
        return f"{self.linear.describe()}; routed experts {self.experts.describe()}"


def kv_bytes(dtype: str) -> int:
    if dtype not in KV_DTYPE_BYTES:
        raise ValueError(f"unknown KV dtype {dtype!r} (known: {', '.join(KV_DTYPE_BYTES)})")
    return KV_DTYPE_BYTES[dtype]
