"""Linear layers whose weights stay FP8 (block-scaled, DeepSeek-V3 checkpoint format) on the GPU.

Each holds weight [out, in] float8_e4m3fn and weight_scale_inv [ceil(out/bn), ceil(in/bk)] float32 and
computes y = x @ dequant(weight).T inside the GEMM (engine.kernels.fp8_gemm): torch._scaled_mm where it
fits (FP8 activations, block multiples, and a one-time numerical check against the reference on this
device), else the Triton kernel. On CPU the engine keeps dequantising on load (engine.weights.checkpoint) and never
builds these; their CPU forward is the torch reference (tests). Tensor-parallel forms mirror
engine.layers.linear: column-parallel splits output rows, row-parallel splits input columns and shows its
all_reduce; a shard must start on a quantisation-block boundary so it owns whole scale blocks.
"""
from __future__ import annotations

import functools
import logging

import torch
from torch import nn

from engine.runtime.distributed import TPGroup
from engine.kernels.fp8_quant import fp8_gemm_reference, quantize_per_token_group

logger = logging.getLogger(__name__)

Block = tuple[int, int]


def shard_block_scale(scale_inv: torch.Tensor, start: int, end: int, dim: int, block: int) -> torch.Tensor:
    """The scale blocks covering weight rows (dim 0) or columns (dim 1) [start, end); start must be a
    multiple of the block so the shard owns whole blocks (end may be the ragged tensor end)."""
    if start % block:
        raise ValueError(f"FP8 shard [{start}, {end}) does not start on a {block}-wide quantisation block: "
                         "choose a TP size that splits the weight at block boundaries")
    return scale_inv.narrow(dim, start // block, -(-end // block) - start // block)


def _scaled_mm(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """torch._scaled_mm with 1x128 activation and 128x128 weight scales (recent torch on SM90+ / MI300+)."""
    quantised, scale = quantize_per_token_group(x, 128)
    return torch._scaled_mm(quantised, weight.t(), scale_a=scale, scale_b=scale_inv.t(), out_dtype=out_dtype)


@functools.cache
def scaled_mm_works(device: torch.device) -> bool:
    """Whether _scaled_mm takes block scales on this device and agrees with the reference (checked once)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(32, 256, generator=generator).to(device, torch.bfloat16)
    weight = torch.randn(256, 256, generator=generator).to(device, torch.float8_e4m3fn)
    scale_inv = torch.rand(2, 2, generator=generator).add(0.5).to(device)
    try:
        out = _scaled_mm(x, weight, scale_inv, torch.bfloat16).float()
    except (RuntimeError, TypeError, ValueError) as error:
        logger.info("torch._scaled_mm with block scales unavailable here (%s); using the Triton FP8 GEMM", error)
        return False
    expected = fp8_gemm_reference(x.float(), weight, scale_inv, (128, 128), act_fp8=True)
    close = torch.allclose(out, expected, rtol=3e-2, atol=3e-1)
    logger.info("torch._scaled_mm block-scaled FP8 on %s: %s", device, "used" if close else "wrong result, not used")
    return close


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: Block, act_fp8: bool) -> torch.Tensor:
    """x [T, in] -> [T, out] in x.dtype with the weight kept FP8."""
    if x.device.type != "cuda":
        return fp8_gemm_reference(x, weight, scale_inv, block, act_fp8)
    aligned = block == (128, 128) and weight.shape[0] % 128 == 0 and weight.shape[1] % 128 == 0
    if act_fp8 and aligned and scaled_mm_works(x.device):
        return _scaled_mm(x, weight, scale_inv, x.dtype)
    from engine.kernels.fp8_gemm import fp8_block_gemm

    return fp8_block_gemm(x, weight, scale_inv, block, act_fp8)


class Fp8Linear(nn.Module):
    """FP8 weight [out, in] + weight_scale_inv; `parallel` is "replicated", "column" or "row" (row-parallel
    all_reduces its output unless reduce=False, as RowParallelLinear)."""

    def __init__(self, in_features: int, out_features: int, tp: TPGroup, parallel: str = "replicated",
                 block: Block = (128, 128), act_fp8: bool = False, reduce: bool = True) -> None:
        super().__init__()
        if parallel not in ("replicated", "column", "row"):
            raise ValueError(f"parallel must be replicated, column or row, got {parallel!r}")
        self.tp, self.parallel, self.block, self.act_fp8, self.reduce = tp, parallel, block, act_fp8, reduce
        self.full_shape = (out_features, in_features)
        self.out_range = tp.shard_range(out_features) if parallel == "column" else (0, out_features)
        self.in_range = tp.shard_range(in_features) if parallel == "row" else (0, in_features)
        rows, cols = self.out_range[1] - self.out_range[0], self.in_range[1] - self.in_range[0]
        self.weight = nn.Parameter(torch.empty(rows, cols, dtype=torch.float8_e4m3fn), requires_grad=False)
        self.weight_scale_inv = nn.Parameter(
            torch.empty(-(-rows // block[0]), -(-cols // block[1]), dtype=torch.float32), requires_grad=False)

    def load_full(self, weight: torch.Tensor, scale_inv: torch.Tensor) -> None:
        """Copies this rank's shard of the full checkpoint weight [out, in] (fp8) and its scale_inv."""
        if tuple(weight.shape) != self.full_shape:
            raise ValueError(f"FP8 weight {tuple(weight.shape)} does not match the layer's {self.full_shape}")
        blocks = (-(-weight.shape[0] // self.block[0]), -(-weight.shape[1] // self.block[1]))
        if tuple(scale_inv.shape) != blocks:
            raise ValueError(f"FP8 weight_scale_inv {tuple(scale_inv.shape)} does not tile {tuple(weight.shape)} "
                             f"in {self.block} blocks (expected {blocks})")
        (r0, r1), (c0, c1) = self.out_range, self.in_range
        scale = shard_block_scale(shard_block_scale(scale_inv, r0, r1, 0, self.block[0]), c0, c1, 1, self.block[1])
        self.weight.data.copy_(weight[r0:r1, c0:c1])
        self.weight_scale_inv.data.copy_(scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = fp8_linear(x, self.weight, self.weight_scale_inv, self.block, self.act_fp8)
        if self.parallel == "row" and self.reduce:
            out = self.tp.all_reduce(out)
        return out

    def extra_repr(self) -> str:
        return f"in={self.full_shape[1]}, out={self.full_shape[0]}, {self.parallel}, block={self.block}, fp8"
