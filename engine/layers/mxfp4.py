"""MXFP4 (compressed-tensors "mxfp4-pack-quantized") weights, kept packed in memory.

A weight [out, in] is stored as
  weight_packed [out, in / 2] uint8: two FP4 E2M1 codes per byte, low nibble = even input column,
                high nibble = odd; code bit 3 = sign, bits 0..2 index {0, 0.5, 1, 1.5, 2, 3, 4, 6};
  weight_scale  [out, in / 32] uint8: one UE8M0 exponent s per 32 consecutive input columns,
so that w = fp4 * 2^(s - 127). QAT checkpoints are used as stored (never re-encoded).

PackedExperts holds a stack of such weights (the routed experts of one MoE layer on this rank). On CUDA the
Triton kernel (engine/kernels/mxfp4_gemm.py) decodes the codes in its K loop and never materialises the
weight. Elsewhere a layer's experts are decoded to float32 once and kept while that copy fits the cap
(PDSERVE_MXFP4_DECODED_MB, per layer; 0: never), so no step decodes the same constant weights again; above
the cap the torch reference decodes one expert's weight per matmul. Both give the same values (decoding is
elementwise), so the cap changes speed and memory, never outputs.
"""
from __future__ import annotations

import os
from collections.abc import Mapping

import torch
from torch import nn

GROUP_SIZE = 32
SCALE_BIAS = 127
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Off CUDA, a layer's experts whose float32 copy takes at most this many bytes are decoded once and kept
# (PackedExperts.dequantized): decoding the same constant weights again every step is not model maths.
# PDSERVE_MXFP4_DECODED_MB sets it (MiB per MoE layer and rank; 0 keeps only the packed copy).
DEQUANT_CACHE_ENV = "PDSERVE_MXFP4_DECODED_MB"


def _cache_cap_bytes(environ: Mapping[str, str] = os.environ) -> int:
    """The per-layer cap on decoded experts from DEQUANT_CACHE_ENV (default 64 MiB); a bad value is a ValueError."""
    text = environ.get(DEQUANT_CACHE_ENV, "64")
    try:
        megabytes = float(text)
    except ValueError:
        raise ValueError(f"{DEQUANT_CACHE_ENV} must be a number of MiB, got {text!r}") from None
    if megabytes < 0 or megabytes != megabytes:
        raise ValueError(f"{DEQUANT_CACHE_ENV} must be >= 0 MiB, got {text!r}")
    return int(megabytes * 2**20)


DEQUANT_CACHE_MAX_BYTES = _cache_cap_bytes()


def _check_packed(packed: torch.Tensor, scale: torch.Tensor) -> None:
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise ValueError(f"MXFP4 tensors must be uint8, got packed {packed.dtype} and scale {scale.dtype}")
    if packed.shape[:-1] != scale.shape[:-1] or packed.shape[-1] * 2 != scale.shape[-1] * GROUP_SIZE:
        raise ValueError(f"MXFP4 packed {tuple(packed.shape)} and scale {tuple(scale.shape)} disagree "
                         f"(expected scale [..., packed_cols * 2 / {GROUP_SIZE}])")


def fp4_codes_to_float(codes: torch.Tensor) -> torch.Tensor:
    """codes: uint8 in 0..15 (any shape) -> float32 E2M1 values."""
    table = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=codes.device)
    magnitude = table[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -magnitude, magnitude)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """packed: [..., in / 2] uint8 -> codes [..., in] uint8 (low nibble first)."""
    low, high = packed & 0x0F, packed >> 4
    return torch.stack([low, high], dim=-1).flatten(-2)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """codes: [..., in] uint8 in 0..15 (in even) -> [..., in / 2] uint8, even column in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"cannot pack an odd number of FP4 columns ({codes.shape[-1]})")
    pairs = codes.to(torch.uint8).unflatten(-1, (-1, 2))
    return pairs[..., 0] | (pairs[..., 1] << 4)


_BYTE_TABLES: dict[torch.device, torch.Tensor] = {}


def _byte_table(device: torch.device) -> torch.Tensor:
    """[256, 2] float32: the (even column, odd column) values of every packed byte."""
    if device not in _BYTE_TABLES:
        codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
        _BYTE_TABLES[device] = fp4_codes_to_float(unpack_fp4(codes.unsqueeze(1))).to(device)
    return _BYTE_TABLES[device]


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """packed [..., out, in/2], scale [..., out, in/32] -> weight [..., out, in] in dtype (exact in float32).
    One table lookup per byte gives both of its columns."""
    _check_packed(packed, scale)
    values = _byte_table(packed.device)[packed.long()].flatten(-2)
    factor = torch.exp2(scale.float() - SCALE_BIAS).repeat_interleave(GROUP_SIZE, dim=-1)
    return (values * factor).to(dtype)


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., out, in] (in % 32 == 0) -> (packed uint8, scale uint8): round-to-nearest E2M1 with each
    group's exponent chosen so its largest magnitude fits under 6. For building test checkpoints."""
    if weight.shape[-1] % GROUP_SIZE:
        raise ValueError(f"MXFP4 needs the input dim to be a multiple of {GROUP_SIZE}, got {weight.shape[-1]}")
    groups = weight.float().unflatten(-1, (-1, GROUP_SIZE))
    amax = groups.abs().amax(dim=-1).clamp(min=2.0 ** -100)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-SCALE_BIAS, SCALE_BIAS)
    scaled = groups / torch.exp2(exponent).unsqueeze(-1)
    table = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=weight.device)
    index = (scaled.abs().unsqueeze(-1) - table).abs().argmin(dim=-1)
    codes = index.to(torch.uint8) | ((scaled < 0).to(torch.uint8) << 3)
    packed = pack_fp4(codes.flatten(-2))
    return packed, (exponent + SCALE_BIAS).to(torch.uint8)


def mxfp4_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [T, in] @ dequant(W)^T -> [T, out] float32, W stored packed [out, in/2] + scale [out, in/32].

    On CUDA the Triton kernel dequantises in its K loop; elsewhere the torch reference dequantises
    this one weight in float32 for the matmul (the packed copy stays the resident one)."""
    if x.is_cuda:
        from engine.kernels.mxfp4_gemm import mxfp4_gemm

        return mxfp4_gemm(x, packed, scale)
    return x.float() @ dequantize_mxfp4(packed, scale).t()


class PackedExperts(nn.Module):
    """The routed experts of one layer on one rank, MXFP4-packed as stored (w13 = gate rows then up rows):

    w13_packed [E, 2I, hidden/2] uint8, w13_scale [E, 2I, hidden/32] uint8 (w1 = gate, w3 = up)
    w2_packed  [E, hidden, I/2]  uint8, w2_scale  [E, hidden, I/32]  uint8 (down)
    where hidden is the experts' input width (LatentMoE: the latent width)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        for name, value in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size)):
            if value % GROUP_SIZE:
                raise ValueError(f"MXFP4 experts need {name} divisible by {GROUP_SIZE}, got {value}")
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        gate_up, inter = 2 * intermediate_size, intermediate_size
        self.register_buffer("w13_packed", torch.zeros(num_experts, gate_up, hidden_size // 2, dtype=torch.uint8))
        self.register_buffer("w13_scale", torch.zeros(num_experts, gate_up, hidden_size // GROUP_SIZE, dtype=torch.uint8))
        self.register_buffer("w2_packed", torch.zeros(num_experts, hidden_size, inter // 2, dtype=torch.uint8))
        self.register_buffer("w2_scale", torch.zeros(num_experts, hidden_size, inter // GROUP_SIZE, dtype=torch.uint8))
        self._decoded: tuple[torch.Tensor, torch.Tensor] | None = None  # dequantized(): decoded weights, their key
        self._decoded_key: tuple = ((), ())

    def target(self, expert: int, projection: str, part: str) -> torch.Tensor:
        """The slice a checkpoint tensor experts.{expert}.{w1|w2|w3}.weight_{packed|scale} is copied into."""
        if part not in ("packed", "scale") or projection not in ("w1", "w2", "w3"):
            raise ValueError(f"unknown MXFP4 expert tensor {projection}.weight_{part}")
        if projection == "w2":
            return getattr(self, f"w2_{part}")[expert]
        stacked = getattr(self, f"w13_{part}")[expert]
        inter = self.intermediate_size
        return stacked[:inter] if projection == "w1" else stacked[inter:]

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Every expert's weights in float32, (gate_up [E, 2I, hidden], down [E, hidden, I]), decoded once and
        kept (re-decoded when a buffer is written again), for the CPU torch paths (the dense one and gate_up /
        down); None on CUDA (the Triton kernel decodes in its K loop) or when the float32 copy would exceed
        DEQUANT_CACHE_MAX_BYTES (the packed copy stays the resident one and each matmul decodes its expert)."""
        decoded_bytes = 4 * 2 * (self.w13_packed.numel() + self.w2_packed.numel())  # two columns per byte
        if self.w13_packed.is_cuda or decoded_bytes > DEQUANT_CACHE_MAX_BYTES:
            return None
        sources = (self.w13_packed, self.w13_scale, self.w2_packed, self.w2_scale)
        key = tuple((id(buffer), buffer._version) for buffer in sources)
        if self._decoded is None or self._decoded_key[0] != key:
            self._decoded = (dequantize_mxfp4(self.w13_packed, self.w13_scale),
                             dequantize_mxfp4(self.w2_packed, self.w2_scale))
            self._decoded_key = (key, sources)  # the sources kept: their ids stay theirs
        return self._decoded

    def gate_up(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, 2I] float32 (gate columns then up columns); over the kept decoded copy when
        there is one (the same values mxfp4_linear would decode)."""
        decoded = self.dequantized()
        if decoded is not None:
            return x.float() @ decoded[0][expert].t()
        return mxfp4_linear(x, self.w13_packed[expert], self.w13_scale[expert])

    def down(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """x [T, I] -> [T, hidden] float32 (over the kept decoded copy when there is one)."""
        decoded = self.dequantized()
        if decoded is not None:
            return x.float() @ decoded[1][expert].t()
        return mxfp4_linear(x, self.w2_packed[expert], self.w2_scale[expert])

    @property
    def resident_bytes(self) -> int:
        return sum(buffer.numel() * buffer.element_size() for buffer in self.buffers())

    def bf16_bytes(self) -> int:
        """What the same experts would take as bf16 weights."""
        return 2 * self.num_experts * 3 * self.hidden_size * self.intermediate_size
