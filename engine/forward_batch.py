"""Per-step state passed explicitly through the model: what to run and where the cache is."""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class ForwardMode(enum.Enum):
    """EXTEND: MHA form (latent decompressed through kv_b_proj), used for prefill and chunked prefill.
    DECODE: absorbed form (W_UK folded into q, W_UV after), reads the paged latent cache directly;
    a sequence may bring several query tokens (speculative verification)."""

    EXTEND = "extend"
    DECODE = "decode"


@dataclass(frozen=True)
class AttentionMetadata:
    """Where each sequence's queries sit and where its cached context lives.

    Sequence i owns query rows cu_seqlens_q[i]:cu_seqlens_q[i+1]. They are the LAST q_len_i
    positions of a context of kv_lens[i] tokens (causal mask aligned bottom-right: query j of
    sequence i sees context positions 0 .. kv_lens[i] - q_len_i + j). The latent vectors of the
    new tokens are written to slot_mapping (page_id * page_size + offset) BEFORE attention runs, so
    attention always reads every context token, new ones included, from the paged cache.

    cu_seqlens_q: [num_seqs + 1] int32
    kv_lens:      [num_seqs] int32, context length including the new tokens
    block_table:  [num_seqs, max_pages] int32, page ids in order; unused entries are 0
    slot_mapping: [num_tokens] int64
    q_lens_cpu / kv_lens_cpu: the same lengths as Python tuples (no device sync needed)
    """

    cu_seqlens_q: torch.Tensor
    kv_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    q_lens_cpu: tuple[int, ...]
    kv_lens_cpu: tuple[int, ...]
    page_size: int

    @property
    def num_seqs(self) -> int:
        return len(self.q_lens_cpu)

    @property
    def max_q_len(self) -> int:
        return max(self.q_lens_cpu)

    @property
    def max_kv_len(self) -> int:
        return max(self.kv_lens_cpu)

    @property
    def is_fresh_prefill(self) -> bool:
        """True when no sequence has cached context before its new tokens."""
        return self.q_lens_cpu == self.kv_lens_cpu


@dataclass(frozen=True)
class ForwardBatch:
    """One model step.

    input_ids: [num_tokens] int64
    positions: [num_tokens] int64 (absolute positions, used by RoPE)
    state_slots: [num_seqs] int64, the state-pool slot each sequence owns (models with linear-attention
        layers only; None otherwise). Sequence i's tokens continue from the slot's content.
    """

    mode: ForwardMode
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn: AttentionMetadata
    state_slots: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def build_attention_metadata(
    q_lens: list[int],
    kv_lens: list[int],
    page_tables: list[list[int]],
    page_size: int,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Builds metadata for sequences whose new tokens are the last q_lens[i] of kv_lens[i] positions."""
    if not (len(q_lens) == len(kv_lens) == len(page_tables)) or not q_lens:
        raise ValueError("q_lens, kv_lens and page_tables must be non-empty and of equal length")
    cu = [0]
    slots: list[int] = []
    for q_len, kv_len, pages in zip(q_lens, kv_lens, page_tables):
        if q_len <= 0 or q_len > kv_len:
            raise ValueError(f"bad lengths q_len={q_len} kv_len={kv_len}")
        if len(pages) * page_size < kv_len:
            raise ValueError(f"{len(pages)} pages of {page_size} cannot hold {kv_len} tokens")
        cu.append(cu[-1] + q_len)
        for pos in range(kv_len - q_len, kv_len):
            slots.append(pages[pos // page_size] * page_size + pos % page_size)
    max_pages = max(len(p) for p in page_tables)
    table = torch.zeros((len(page_tables), max_pages), dtype=torch.int32)
    for i, pages in enumerate(page_tables):
        if pages:
            table[i, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
    return AttentionMetadata(
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
        kv_lens=torch.tensor(kv_lens, dtype=torch.int32, device=device),
        block_table=table.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        q_lens_cpu=tuple(q_lens),
        kv_lens_cpu=tuple(kv_lens),
        page_size=page_size,
    )
