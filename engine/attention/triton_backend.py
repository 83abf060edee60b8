"""Attention backend on our own Triton kernels (CUDA / ROCm GPUs; CPU only under TRITON_INTERPRET=1)."""
from __future__ import annotations

import torch

from engine.attention import triton_kernels
from engine.attention.base import AttentionBackend, VarlenSpans
from engine.attention.triton_kernels import Tiles
from engine.attention.triton_kernels import decode as decode_kernels
from engine.attention.triton_kernels import prefill as prefill_kernels
from engine.runtime.forward_batch import AttentionMetadata


class TritonAttentionBackend(AttentionBackend):
    """Both kernels process `head_block` heads per program (triton_kernels.Tiles), so head counts must be
    multiples of it (registry.get_attention_backend wraps the backend in HeadPaddedBackend otherwise: 12 -> 16)."""

    name = "triton"
    graph_safe = True  # the decode kernel loops over kv_lens read on the device

    def __init__(self, head_block: int = 16, decode_splits: int | None = None) -> None:
        """decode_splits: key ranges per decode context (None: chosen per step from the GPU's size)."""
        if decode_splits is not None and decode_splits < 1:
            raise ValueError(f"decode_splits must be positive, got {decode_splits}")
        self.tiles = Tiles(head_block)
        self.decode_splits = decode_splits

    def supports_num_heads(self, num_heads: int) -> bool:
        return num_heads > 0 and num_heads % self.tiles.head_block == 0

    def _check_device(self, tensor: torch.Tensor) -> None:
        if tensor.device.type == "cpu" and not triton_kernels.kernels_interpreted():
            raise RuntimeError(
                "Triton kernels got CPU tensors but were compiled for a GPU: set TRITON_INTERPRET=1 before "
                "engine.attention.triton_kernels is first imported to run them in the interpreter"
            )

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans: VarlenSpans,
                softmax_scale: float) -> torch.Tensor:
        """q: [Tq, H, Dqk], k: [Tk, H, Dqk], v: [Tk, H, Dv] -> [Tq, H, Dv] in q's dtype."""
        self._check_device(q)
        return prefill_kernels.flash_prefill(q, k, v, spans.cu_seqlens_q, spans.cu_seqlens_k, spans.max_q_len,
                                             softmax_scale, self.tiles)

    def decode(self, q: torch.Tensor, kv_cache: torch.Tensor, attn: AttentionMetadata, softmax_scale: float,
               latent_dim: int) -> torch.Tensor:
        self._check_device(q)
        return decode_kernels.paged_decode(
            q, kv_cache, attn.cu_seqlens_q, attn.kv_lens, attn.block_table, attn.max_q_len, attn.max_kv_len,
            latent_dim, softmax_scale, self.tiles, num_splits=self.decode_splits,
        )
