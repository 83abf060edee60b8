"""The attention backend interface: one small class per kernel family, chosen at start-up."""
from __future__ import annotations

import abc
from dataclasses import dataclass

import torch

from engine.runtime.forward_batch import AttentionMetadata


@dataclass(frozen=True)
class VarlenSpans:
    """Where each sequence's rows sit in a packed (varlen) prefill: sequence i owns query rows
    cu_seqlens_q[i]:cu_seqlens_q[i+1] and key/value rows cu_seqlens_k[i]:cu_seqlens_k[i+1]; its queries
    are the last q_lens[i] of its k_lens[i] positions (causal, bottom-right).

    cu_seqlens_q / cu_seqlens_k: [num_seqs + 1] integer tensors on the attention device;
    q_lens / k_lens: the same lengths as Python tuples (no device sync needed)."""

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    q_lens: tuple[int, ...]
    k_lens: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.q_lens) != len(self.k_lens):
            raise ValueError(f"q_lens has {len(self.q_lens)} sequences, k_lens {len(self.k_lens)}")
        if any(k_len < q_len for q_len, k_len in zip(self.q_lens, self.k_lens)):
            raise ValueError(f"prefill needs k_len >= q_len, got q_lens={self.q_lens} k_lens={self.k_lens}")

    @classmethod
    def from_lens(cls, q_lens: tuple[int, ...], k_lens: tuple[int, ...],
                  device: torch.device | str = "cpu") -> VarlenSpans:
        """Spans of sequences packed back to back (cumulative sums of the lengths)."""

        def cumulative(lens: tuple[int, ...]) -> torch.Tensor:
            starts = torch.zeros(len(lens) + 1, dtype=torch.int32)
            starts[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int32), 0)
            return starts.to(device)

        return cls(cumulative(tuple(q_lens)), cumulative(tuple(k_lens)), tuple(q_lens), tuple(k_lens))

    @property
    def max_q_len(self) -> int:
        return max(self.q_lens, default=0)

    @property
    def max_k_len(self) -> int:
        return max(self.k_lens, default=0)


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
    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans: VarlenSpans,
                softmax_scale: float) -> torch.Tensor:
        """q: [Tq, H, Dqk], k: [Tk, H, Dqk], v: [Tk, H, Dv] -> out [Tq, H, Dv] (dtype of q); the rows of
        each sequence as `spans` says, causal bottom-right."""

    @abc.abstractmethod
    def decode(self, q: torch.Tensor, kv_cache: torch.Tensor, attn: AttentionMetadata, softmax_scale: float,
               latent_dim: int) -> torch.Tensor:
        """q: [T, H, latent_dim + rope_dim] (absorbed), kv_cache: [num_pages, page_size, latent_dim + rope_dim]
        (one layer; the latent is both key (all dims) and value (first latent_dim dims))
        -> out [T, H, latent_dim] (dtype of q), causal bottom-right per sequence."""
