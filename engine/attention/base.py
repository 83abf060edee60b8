"""The attention backend interface: one small class per kernel family, chosen at start-up."""
from __future__ import annotations

import abc

import torch

from engine.forward_batch import AttentionMetadata


class AttentionBackend(abc.ABC):
    """Prefill (MHA form, varlen causal) and decode (absorbed form over the paged latent cache).

    Causal masks are aligned bottom-right: the queries of a sequence are the last q_len positions
    of its context (see AttentionMetadata). softmax_scale is always passed explicitly.
    """

    name: str = "abstract"
    # True when decode reads sequence lengths only from device tensors (so a CUDA graph can replay it).
    graph_safe: bool = False

    @abc.abstractmethod
    def supports_num_heads(self, num_heads: int) -> bool:
        """Whether the kernels run with this many query heads (per rank)."""

    @abc.abstractmethod
    def prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        q_lens: tuple[int, ...],
        k_lens: tuple[int, ...],
        softmax_scale: float,
    ) -> torch.Tensor:
        """q: [Tq, H, Dqk], k: [Tk, H, Dqk], v: [Tk, H, Dv] -> out [Tq, H, Dv] (dtype of q).

        Sequence i: q rows cu_seqlens_q[i]:cu_seqlens_q[i+1], k/v rows cu_seqlens_k[i]:cu_seqlens_k[i+1],
        causal bottom-right (k_lens[i] >= q_lens[i])."""

    @abc.abstractmethod
    def decode(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        attn: AttentionMetadata,
        softmax_scale: float,
        latent_dim: int,
    ) -> torch.Tensor:
        """q: [T, H, latent_dim + rope_dim] (absorbed), kv_cache: [num_pages, page_size, latent_dim + rope_dim]
        (one layer; the latent is both key (all dims) and value (first latent_dim dims))
        -> out [T, H, latent_dim] (dtype of q), causal bottom-right per sequence."""
