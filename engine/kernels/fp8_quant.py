"""FP8 (e4m3) maths in plain torch: 128x128 weight blocks (DeepSeek-V3's checkpoint format), 1 x group
activation groups per token, and the block-scaled GEMM reference that the Triton kernel
(engine.kernels.fp8_gemm) is tested against. Pure functions, device-agnostic, no triton."""
from __future__ import annotations

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max


def dequantize_fp8_block(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128), dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """weight: [..., rows, cols] fp8, scale_inv: [..., ceil(rows/bn), ceil(cols/bk)] -> weight * scale per
    block, in dtype (leading dims: stacked experts)."""
    rows, cols = weight.shape[-2:]
    scale = scale_inv.float().repeat_interleave(block[0], dim=-2)[..., :rows, :]
    scale = scale.repeat_interleave(block[1], dim=-1)[..., :cols]
    return (weight.float() * scale).to(dtype)


def quantize_fp8_block(weight: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """weight: [rows, cols] -> (e4m3 weight [rows, cols], float32 scale_inv [ceil(rows/bn), ceil(cols/bk)])
    with each block scaled so its largest magnitude maps to the e4m3 maximum."""
    rows, cols = weight.shape
    bn, bk = block
    grid = (-(-rows // bn), -(-cols // bk))
    padded = torch.zeros(grid[0] * bn, grid[1] * bk, dtype=torch.float32, device=weight.device)
    padded[:rows, :cols] = weight.float()
    blocks = padded.view(grid[0], bn, grid[1], bk)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale_inv = amax / E4M3_MAX
    quantised = (blocks / scale_inv[:, None, :, None]).view_as(padded)[:rows, :cols]
    return quantised.to(torch.float8_e4m3fn), scale_inv


def quantize_per_token_group(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [M, K] -> (e4m3 [M, K], float32 scale [M, ceil(K/group)]), each token's group of `group` values
    scaled so its largest magnitude maps to the e4m3 maximum (x ~= quantised * scale)."""
    rows, cols = x.shape
    groups = -(-cols // group)
    padded = torch.zeros(rows, groups * group, dtype=torch.float32, device=x.device)
    padded[:, :cols] = x.float()
    scale = padded.view(rows, groups, group).abs().amax(dim=2).clamp(min=1e-12) / E4M3_MAX
    quantised = (padded.view(rows, groups, group) / scale[:, :, None]).view(rows, -1)[:, :cols]
    return quantised.to(torch.float8_e4m3fn).contiguous(), scale


def dequantize_per_token_group(quantised: torch.Tensor, scale: torch.Tensor, group: int = 128) -> torch.Tensor:
    """[M, K] fp8 and [M, ceil(K/group)] scales -> [M, K] float32."""
    return quantised.float() * scale.repeat_interleave(group, dim=1)[:, : quantised.shape[1]]


def check_fp8_gemm_shapes(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> None:
    """ValueError unless x [..., K] meets weight [N, K] and scale_inv tiles the weight in `block` blocks."""
    rows, cols = weight.shape
    if x.shape[-1] != cols:
        raise ValueError(f"fp8 GEMM: x has {x.shape[-1]} input features, weight {tuple(weight.shape)} wants {cols}")
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale_inv.shape) != grid:
        raise ValueError(f"fp8 GEMM: weight_scale_inv {tuple(scale_inv.shape)} should be {grid} for weight "
                         f"{tuple(weight.shape)} in {block[0]}x{block[1]} blocks")


def fp8_gemm_reference(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                       block: tuple[int, int] = (128, 128), act_fp8: bool = False) -> torch.Tensor:
    """x [..., K], weight [N, K] fp8, scale_inv [ceil(N/bn), ceil(K/bk)] -> [..., N] in x.dtype (fp32 maths).
    act_fp8: x goes through per-token-group FP8 quantisation first (group = bk), as the kernel's FP8 mode."""
    check_fp8_gemm_shapes(x, weight, scale_inv, block)
    flat = x.reshape(-1, x.shape[-1])
    if act_fp8:
        quantised, scale = quantize_per_token_group(flat, block[1])
        flat = dequantize_per_token_group(quantised, scale, block[1])
    out = flat.float() @ dequantize_fp8_block(weight, scale_inv, block).T
    return out.to(x.dtype).view(*x.shape[:-1], weight.shape[0])
