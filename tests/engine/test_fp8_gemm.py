"""Block-scaled FP8 GEMM: the per-token-group activation quantiser round-trips within e4m3 precision; the
torch reference equals dequantise-then-matmul; the Triton kernel (interpreter on CPU, device with -m gpu)
equals the reference with bf16/fp32 activations (weight dequantised in the K loop) and with FP8
activations, for shapes that are not block multiples; bad scale shapes and BLOCK_K are refused."""
from __future__ import annotations

import pytest
import torch

from engine.kernels.fp8_gemm import fp8_block_gemm
from engine.kernels.fp8_quant import (
    dequantize_fp8_block,
    dequantize_per_token_group,
    fp8_gemm_reference,
    quantize_fp8_block,
    quantize_per_token_group,
)


def _case(rows: int, cols: int, tokens: int, block: tuple[int, int], seed: int, device: str = "cpu"):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, cols, generator=generator)
    quantised, scale_inv = quantize_fp8_block(weight, block)
    x = torch.randn(tokens, cols, generator=generator)
    return x.to(device), quantised.to(device), scale_inv.to(device)


def test_token_group_quantisation_round_trips():
    """Each token's group is scaled to the e4m3 range: dequantised values are within e4m3's relative step
    (2^-3) of the input, and the group maximum maps to 448."""
    x = torch.randn(6, 200, generator=torch.Generator().manual_seed(0)) * torch.logspace(-2, 2, 6)[:, None]
    quantised, scale = quantize_per_token_group(x, 64)
    assert quantised.dtype == torch.float8_e4m3fn and scale.shape == (6, 4)
    restored = dequantize_per_token_group(quantised, scale, 64)
    assert bool(((restored - x).abs() <= x.abs() * 2**-3 + scale.repeat_interleave(64, 1)[:, :200] * 2**-6).all())
    assert quantised.float().abs().amax().item() == pytest.approx(448.0)


@pytest.mark.parametrize("act_fp8", [False, True], ids=["bf16-act", "fp8-act"])
def test_reference_is_dequantise_then_matmul(act_fp8):
    """fp8_gemm_reference = x (optionally token-group quantised) @ dequant(weight).T, any leading dims."""
    x, weight, scale_inv = _case(48, 80, 6, (16, 32), seed=1)
    x = x.view(2, 3, 80)
    out = fp8_gemm_reference(x, weight, scale_inv, (16, 32), act_fp8=act_fp8)
    flat = x.reshape(6, 80)
    if act_fp8:
        flat = dequantize_per_token_group(*quantize_per_token_group(flat, 32), 32)
    expected = flat @ dequantize_fp8_block(weight, scale_inv, (16, 32)).T
    torch.testing.assert_close(out, expected.view(2, 3, 48))


@pytest.mark.parametrize("act_fp8", [False, True], ids=["fp32-act", "fp8-act"])
@pytest.mark.parametrize(("rows", "cols", "tokens", "block"), [(40, 72, 5, (16, 32)), (64, 128, 17, (32, 64))],
                         ids=["ragged", "aligned"])
def test_kernel_matches_reference_in_the_interpreter(act_fp8, rows, cols, tokens, block):
    """The Triton kernel (fp32 accumulate, scales applied per K tile) equals the reference to fp32 rounding."""
    x, weight, scale_inv = _case(rows, cols, tokens, block, seed=rows)
    out = fp8_block_gemm(x, weight, scale_inv, block, act_fp8=act_fp8, block_m=16, block_n=16, block_k=16)
    torch.testing.assert_close(out, fp8_gemm_reference(x, weight, scale_inv, block, act_fp8=act_fp8),
                               rtol=1e-5, atol=1e-4)


def test_bad_scale_shape_and_block_k_are_refused():
    """A weight_scale_inv that does not tile the weight, or a BLOCK_K that does not divide the quantisation
    block, is a ValueError naming the problem."""
    x, weight, scale_inv = _case(32, 64, 2, (16, 32), seed=2)
    with pytest.raises(ValueError, match="weight_scale_inv"):
        fp8_gemm_reference(x, weight, scale_inv[:1], (16, 32))
    with pytest.raises(ValueError, match="BLOCK_K"):
        fp8_block_gemm(x, weight, scale_inv, (16, 32), block_k=24)
    with pytest.raises(ValueError, match="input features"):
        fp8_block_gemm(x[:, :32], weight, scale_inv, (16, 32))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA / ROCm GPU")
@pytest.mark.parametrize("act_fp8", [False, True], ids=["bf16-act", "fp8-act"])
def test_kernel_on_the_device(act_fp8):
    """On the GPU, 128x128 blocks with bf16 activations: the kernel equals the reference within bf16 rounding."""
    x, weight, scale_inv = _case(512, 1024, 64, (128, 128), seed=3, device="cuda")
    x = x.bfloat16()
    out = fp8_block_gemm(x, weight, scale_inv, act_fp8=act_fp8)
    reference = fp8_gemm_reference(x.float(), weight, scale_inv, act_fp8=act_fp8)
    torch.testing.assert_close(out.float(), reference, rtol=2e-2, atol=2e-1)
