"""MXFP4 weights: the bit layout read as stored, packed experts kept packed, and the Triton
dequant-in-GEMM kernel (interpreter) equal to the torch reference."""
from __future__ import annotations

import pytest
import torch

from engine.layers.mxfp4 import (
    E2M1_MAGNITUDES, PackedExperts, dequantize_mxfp4, fp4_codes_to_float, mxfp4_linear, pack_fp4,
    quantize_mxfp4, unpack_fp4,
)


def test_bit_layout_low_nibble_is_even_column() -> None:
    """Byte 0x2B -> column 0 = code 0xB (-1.5), column 1 = code 0x2 (1.0); scale 128 doubles both."""
    packed = torch.tensor([[0x2B] + [0] * 15], dtype=torch.uint8)
    scale = torch.tensor([[128]], dtype=torch.uint8)
    weight = dequantize_mxfp4(packed, scale)
    assert weight.shape == (1, 32)
    assert weight[0, :2].tolist() == [-3.0, 2.0]
    assert weight[0, 2:].abs().sum().item() == 0.0


def test_code_table() -> None:
    """Codes 0..7 are the E2M1 magnitudes; codes 8..15 their negatives."""
    codes = torch.arange(16, dtype=torch.uint8)
    values = fp4_codes_to_float(codes)
    assert values[:8].tolist() == list(E2M1_MAGNITUDES)
    assert values[8:].tolist() == [-v for v in E2M1_MAGNITUDES]


def test_pack_unpack_round_trip() -> None:
    """unpack(pack(codes)) == codes for every code in every position."""
    codes = torch.randint(0, 16, (5, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    assert torch.equal(unpack_fp4(pack_fp4(codes)), codes)


def test_quantize_dequantize_is_exact_on_representable_values() -> None:
    """Weights already on the MXFP4 grid survive quantize -> dequantize exactly (per-group scales differ)."""
    gen = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (6, 96), dtype=torch.uint8, generator=gen)
    codes[:, ::32] = 7  # every group holds a 6 so the chosen exponent is the stored one
    scale = torch.randint(120, 134, (6, 3), dtype=torch.uint8, generator=gen)
    weight = dequantize_mxfp4(pack_fp4(codes), scale)
    packed2, scale2 = quantize_mxfp4(weight)
    assert torch.equal(dequantize_mxfp4(packed2, scale2), weight)


def test_shape_mismatch_is_an_error() -> None:
    """A scale that does not cover the packed columns is a ValueError."""
    with pytest.raises(ValueError, match="disagree"):
        dequantize_mxfp4(torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 2, dtype=torch.uint8))


def _random_packed(rows: int, cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=gen)
    scale = torch.randint(122, 131, (rows, cols // 32), dtype=torch.uint8, generator=gen)
    return packed, scale


@pytest.mark.parametrize("m,n,k", [(1, 32, 32), (5, 48, 96), (37, 64, 160), (16, 96, 64)])
def test_triton_kernel_matches_torch(m: int, n: int, k: int) -> None:
    """The Triton kernel (interpreter) equals x @ dequant(W)^T within fp32 rounding, masked edges included."""
    from engine.kernels.mxfp4_gemm import mxfp4_gemm

    packed, scale = _random_packed(n, k, seed=m + n + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k))
    expected = x @ dequantize_mxfp4(packed, scale).t()
    got = mxfp4_gemm(x, packed, scale)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-5)


def test_triton_kernel_reads_strided_views() -> None:
    """An expert slice of a stacked [E, N, K/2] buffer and a bf16 x give the reference result."""
    from engine.kernels.mxfp4_gemm import mxfp4_gemm

    experts = PackedExperts(3, 64, 32)
    gen = torch.Generator().manual_seed(3)
    experts.w13_packed.copy_(torch.randint(0, 256, experts.w13_packed.shape, dtype=torch.uint8, generator=gen))
    experts.w13_scale.fill_(127)
    x = torch.randn(7, 64, generator=gen).bfloat16()
    expected = mxfp4_linear(x, experts.w13_packed[1], experts.w13_scale[1])
    got = mxfp4_gemm(x, experts.w13_packed[1], experts.w13_scale[1])
    torch.testing.assert_close(got, expected, atol=1e-3, rtol=1e-5)


def test_packed_experts_are_under_30_percent_of_bf16_at_k3_shapes() -> None:
    """K3's expert shapes (latent 3584, intermediate 3072) take 17,547,264 B packed = 26.6% of bf16."""
    experts = PackedExperts(1, 3584, 3072)
    assert experts.resident_bytes == 17_547_264
    assert experts.resident_bytes / experts.bf16_bytes() <= 0.30


def test_packed_experts_targets() -> None:
    """w1 fills the gate rows, w3 the up rows, w2 the down weight of the chosen expert only."""
    experts = PackedExperts(2, 32, 64)
    experts.target(1, "w1", "packed").fill_(1)
    experts.target(1, "w3", "scale").fill_(2)
    experts.target(0, "w2", "packed").fill_(3)
    assert experts.w13_packed[1, :64].eq(1).all() and experts.w13_packed[1, 64:].eq(0).all()
    assert experts.w13_scale[1, 64:].eq(2).all() and experts.w13_scale[1, :64].eq(0).all()
    assert experts.w2_packed[0].eq(3).all() and experts.w2_packed[1].eq(0).all()
    with pytest.raises(ValueError):
        PackedExperts(1, 48, 32)
