"""Run a backend at a head count its kernels do not support by zero-padding the heads.

Fast MLA kernels want 16 (or more) query heads per program; at TP8 a 96-head model has 12 heads
per rank. The wrapper appends zero heads up to the next supported count, runs the inner backend
and slices the real heads back. Heads never interact, so the real heads' outputs are unchanged
(a zero query head just attends uniformly and is thrown away).
"""
from __future__ import annotations

from typing import Callable, Sequence, Union

import torch

from engine.attention.base import AttentionBackend, VarlenSpans
from engine.runtime.forward_batch import AttentionMetadata

HeadSupport = Union[Sequence[int], Callable[[int], bool]]

MAX_HEADS = 1024


def next_supported_head_count(num_heads: int, supported: HeadSupport) -> int:
    """The smallest supported head count >= num_heads.

    supported: an ascending sequence of head counts, or a predicate (e.g. a backend's supports_num_heads).
    Raises ValueError when num_heads < 1 or nothing up to MAX_HEADS is supported."""
    if num_heads < 1:
        raise ValueError(f"num_heads must be positive, got {num_heads}")
    if callable(supported):
        for count in range(num_heads, MAX_HEADS + 1):
            if supported(count):
                return count
    else:
        for count in sorted(supported):
            if count >= num_heads:
                return count
    raise ValueError(f"no supported head count >= {num_heads} (supported: {supported})")


def pad_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """x: [T, H, D] -> [T, num_heads, D] with heads H.. zero (x itself when H == num_heads)."""
    if x.shape[1] == num_heads:
        return x
    padded = x.new_zeros(x.shape[0], num_heads, x.shape[2])
    padded[:, : x.shape[1]] = x
    return padded


def _op_support(inner: AttentionBackend, op: str) -> Callable[[int], bool]:
    """A backend may declare support per op (supports_prefill_num_heads / supports_decode_num_heads);
    otherwise supports_num_heads covers both."""
    return getattr(inner, f"supports_{op}_num_heads", inner.supports_num_heads)


class HeadPaddedBackend(AttentionBackend):
    """Wraps `inner`; pads q (and k, v in prefill) to the next supported head count per op.

    supported: explicit head counts (ascending) or a predicate, applied to both ops; None uses the
    inner backend's own declarations (per op when it has them)."""

    def __init__(self, inner: AttentionBackend, supported: HeadSupport | None = None) -> None:
        self.inner = inner
        self.name = inner.name
        self.graph_safe = inner.graph_safe
        if supported is None:
            self._prefill_support: HeadSupport = _op_support(inner, "prefill")
            self._decode_support: HeadSupport = _op_support(inner, "decode")
        else:
            self._prefill_support = self._decode_support = supported

    def supports_num_heads(self, num_heads: int) -> bool:
        return num_heads >= 1

    def padded_heads(self, num_heads: int, op: str) -> int:
        """Head count the inner backend runs for `op` ("prefill" or "decode")."""
        support = self._prefill_support if op == "prefill" else self._decode_support
        return next_supported_head_count(num_heads, support)

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans: VarlenSpans,
                softmax_scale: float) -> torch.Tensor:
        """q: [Tq, H, Dqk], k: [Tk, H, Dqk], v: [Tk, H, Dv] -> [Tq, H, Dv]; runs the inner at Hp >= H heads."""
        heads = q.shape[1]
        padded = self.padded_heads(heads, "prefill")
        out = self.inner.prefill(pad_heads(q, padded), pad_heads(k, padded), pad_heads(v, padded), spans, softmax_scale)
        return out if padded == heads else out[:, :heads].contiguous()

    def decode(self, q: torch.Tensor, kv_cache: torch.Tensor, attn: AttentionMetadata, softmax_scale: float,
               latent_dim: int) -> torch.Tensor:
        """q: [T, H, latent+rope] -> [T, H, latent]; only q is padded (the latent cache has one shared head)."""
        heads = q.shape[1]
        padded = self.padded_heads(heads, "decode")
        out = self.inner.decode(pad_heads(q, padded), kv_cache, attn, softmax_scale, latent_dim)
        return out if padded == heads else out[:, :heads].contiguous()
