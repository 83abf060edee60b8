"""Optional: fla's (flash-linear-attention) chunked KDA kernel for prefill on CUDA.

Used only when the tensors are on a CUDA device and `fla.ops.kda` imports. Before its first use the
kernel is checked against the torch reference (engine/layers/kda_ops.py) on a small random problem;
if it disagrees, or its signature differs from the one expected, the torch reference is used instead
and a warning says why. The caller passes q / k already L2-normalised with q scaled (scale=1 here),
g the per-channel log-decay, beta pre-sigmoided, state [H, K, V] (K-major, as fla and our pool).
"""
from __future__ import annotations

import importlib
import logging
from typing import Callable

import torch

from engine.layers.kda_ops import kda_chunked, l2_normalize

logger = logging.getLogger(__name__)

CHECK_TOLERANCE = 2e-3
_checked: dict[str, Callable | None] = {}


def _load() -> Callable | None:
    try:
        return importlib.import_module("fla.ops.kda").chunk_kda
    except ImportError:
        return None


def _run(kernel: Callable, q, k, v, g, beta, state) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence through fla: [T, H, .] -> (o [T, H, V] float32, state [H, K, V] float32)."""
    out, final = kernel(q[None].float(), k[None].float(), v[None].float(), g[None].float(), beta[None].float(),
                        scale=1.0, initial_state=state[None].float(), output_final_state=True)
    return out[0].float(), final[0].float()


def _self_check(kernel: Callable, device: torch.device) -> bool:
    gen = torch.Generator().manual_seed(0)
    heads, dim, length = 2, 64, 80
    q = (l2_normalize(torch.randn(length, heads, dim, generator=gen)) * dim ** -0.5).to(device)
    k = l2_normalize(torch.randn(length, heads, dim, generator=gen)).to(device)
    v = torch.randn(length, heads, dim, generator=gen).to(device)
    g = (-torch.rand(length, heads, dim, generator=gen)).to(device)
    beta = torch.rand(length, heads, generator=gen).to(device)
    state = (torch.randn(heads, dim, dim, generator=gen) * 0.1).to(device)
    try:
        got_o, got_s = _run(kernel, q, k, v, g, beta, state)
    except TypeError as error:
        logger.warning("fla chunk_kda has an unexpected signature (%s); using the torch KDA reference", error)
        return False
    ref_o, ref_s = kda_chunked(q, k, v, g, beta, state)
    error = max((got_o - ref_o).abs().max().item(), (got_s - ref_s).abs().max().item())
    if error > CHECK_TOLERANCE:
        logger.warning("fla chunk_kda differs from the torch KDA reference by %.3g; using the reference", error)
        return False
    logger.info("fla chunk_kda agrees with the torch KDA reference (max error %.3g); using it for prefill", error)
    return True


def fla_chunked_kda(device: torch.device) -> Callable | None:
    """A function (q, k, v, g, beta, state) -> (o, state) running fla on `device`, or None (not CUDA,
    fla missing, or fla failed its check against the reference)."""
    if device.type != "cuda":
        return None
    key = str(device)
    if key not in _checked:
        kernel = _load()
        ok = kernel is not None and _self_check(kernel, device)
        _checked[key] = (lambda q, k, v, g, beta, state: _run(kernel, q, k, v, g, beta, state)) if ok else None
    return _checked[key]
