"""Chooses an attention backend by name at start-up. Imports are lazy: a missing triton or aiter only
matters when that backend is asked for, never for `import engine`."""
from __future__ import annotations

import logging
import os

import torch

from engine.attention.base import AttentionBackend
from engine.attention.head_padding import HeadPaddedBackend

logger = logging.getLogger(__name__)

BACKEND_NAMES = ("torch", "triton", "aiter", "auto")


def _interpreter_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _on_rocm() -> bool:
    return getattr(torch.version, "hip", None) is not None


def _make_torch(device: torch.device, dtype: str | None = None) -> AttentionBackend:
    from engine.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend()


def _make_triton(device: torch.device, dtype: str | None = None) -> AttentionBackend:
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"attention backend 'triton' needs a visible GPU for device {device}")
    if device.type == "cpu" and not _interpreter_requested():
        raise ValueError("attention backend 'triton' on CPU needs TRITON_INTERPRET=1 (set before triton kernels load)")
    try:
        from engine.attention import triton_kernels
        from engine.attention.triton_backend import TritonAttentionBackend
    except ImportError as error:
        raise ValueError(f"attention backend 'triton' is unavailable: {error}") from error
    if device.type == "cpu" and not triton_kernels.kernels_interpreted():
        raise ValueError(
            "attention backend 'triton' on CPU: the kernels were already compiled for a GPU (TRITON_INTERPRET "
            "was set after engine.attention.triton_kernels was imported)"
        )
    return TritonAttentionBackend()


def _make_aiter(device: torch.device, dtype: str | None = None) -> AttentionBackend:
    if device.type == "cpu" or not _on_rocm():
        raise ValueError(f"attention backend 'aiter' needs a ROCm GPU (device={device}, hip={_on_rocm()})")
    if dtype is not None:
        from engine.attention.head_table import MLA_DECODE, check_aiter_dtype

        check_aiter_dtype(MLA_DECODE, dtype)  # fp32 refused at start-up (auto then falls back to triton)
    from engine.attention.aiter_backend import AiterAttentionBackend, load_aiter

    try:
        aiter, mla = load_aiter()
    except ImportError as error:
        raise ValueError(f"attention backend 'aiter' is unavailable (pip install amd-aiter): {error}") from error
    return AiterAttentionBackend(aiter, mla)


_FACTORIES = {"torch": _make_torch, "triton": _make_triton, "aiter": _make_aiter}


def _auto_backend(device: torch.device, dtype: str | None) -> tuple[str, AttentionBackend]:
    """aiter on ROCm when importable, triton on CUDA/ROCm GPUs, torch on CPU (or when neither loads)."""
    candidates = ("torch",) if device.type == "cpu" else ("aiter", "triton", "torch") if _on_rocm() else ("triton", "torch")
    for name in candidates[:-1]:
        try:
            return name, _FACTORIES[name](device, dtype)
        except ValueError as error:
            logger.info("auto attention backend: skipping %s (%s)", name, error)
    return candidates[-1], _FACTORIES[candidates[-1]](device, dtype)


def get_attention_backend(
    name: str = "auto", num_heads: int | None = None, device: str = "cpu", dtype: str | None = None
) -> AttentionBackend:
    """The backend `name` ("torch", "triton", "aiter" or "auto") for `device`, wrapped in
    HeadPaddedBackend when num_heads is given and the backend's kernels do not run it natively. dtype (the
    model's, e.g. "float32"): a backend whose kernels refuse it is unavailable (auto skips it).
    Raises ValueError for an unknown or unavailable backend."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}")
    if num_heads is not None and num_heads < 1:
        raise ValueError(f"num_heads must be positive, got {num_heads}")
    torch_device = torch.device(device)
    if name == "auto":
        chosen, backend = _auto_backend(torch_device, dtype)
    else:
        chosen, backend = name, _FACTORIES[name](torch_device, dtype)
    if num_heads is not None and not backend.supports_num_heads(num_heads):
        padded = HeadPaddedBackend(backend)
        prefill_heads, decode_heads = padded.padded_heads(num_heads, "prefill"), padded.padded_heads(num_heads, "decode")
        logger.info("attention backend %s: %d heads run as %d (prefill) / %d (decode) with zero padding",
                    chosen, num_heads, prefill_heads, decode_heads)
        backend = padded
    else:
        logger.info("attention backend %s (device %s)", chosen, torch_device)
    return backend
