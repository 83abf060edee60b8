"""Per-step state passed explicitly through the model: what to run and where the cache is."""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from engine.runtime.devices import host_to_device


class ForwardMode(enum.Enum):
    """EXTEND: MHA form (latent decompressed through kv_b_proj), used for prefill and chunked prefill.
    DECODE: absorbed form (W_UK folded into q, W_UV after), reads the paged latent cache directly;
    a sequence may bring several query tokens (speculative verification).
    MIXED: one forward over decoding sequences and prefill chunks (ForwardBatch.decode_seqs): the first
    decode_seqs sequences, one query token each, take the absorbed form, the rest the MHA form; every other
    layer runs over all the tokens at once (a decode step and a prefill chunk read the weights once)."""

    EXTEND = "extend"
    DECODE = "decode"
    MIXED = "mixed"


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

    def split(self, num_seqs: int) -> tuple["AttentionMetadata", "AttentionMetadata"]:
        """(the first num_seqs sequences, the rest): each part's own metadata, its rows counted from 0 (views
        and one small subtraction, no host work)."""
        if not 0 < num_seqs < self.num_seqs:
            raise ValueError(f"cannot split {self.num_seqs} sequences after {num_seqs}")
        rows = sum(self.q_lens_cpu[:num_seqs])
        head = AttentionMetadata(self.cu_seqlens_q[: num_seqs + 1], self.kv_lens[:num_seqs],
                                 self.block_table[:num_seqs], self.slot_mapping[:rows], self.q_lens_cpu[:num_seqs],
                                 self.kv_lens_cpu[:num_seqs], self.page_size)
        tail = AttentionMetadata(self.cu_seqlens_q[num_seqs:] - rows, self.kv_lens[num_seqs:],
                                 self.block_table[num_seqs:], self.slot_mapping[rows:], self.q_lens_cpu[num_seqs:],
                                 self.kv_lens_cpu[num_seqs:], self.page_size)
        return head, tail


@dataclass(frozen=True)
class ForwardBatch:
    """One model step.

    input_ids: [num_tokens] int64
    positions: [num_tokens] int64 (absolute positions, used by RoPE)
    state_slots: [num_seqs] int64, the state-pool slot each sequence owns (models with linear-attention
        layers only; None otherwise). Sequence i's tokens continue from the slot's content.
    snapshot_state: speculative verify: KDA layers leave the slots untouched and write the state after
        every position into the state pool's snapshot scratch (row i = sequence i), for commit_snapshots.
    state_slots_cpu: the same slots as a Python tuple (no device sync needed), when the builder had them.
    parts: MIXED: (the decoding sequences' metadata, the prefill chunks'), attn.split(decode_seqs) made once per step.
    """

    mode: ForwardMode
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn: AttentionMetadata
    state_slots: torch.Tensor | None = None
    snapshot_state: bool = False
    state_slots_cpu: tuple[int, ...] = ()
    parts: tuple[AttentionMetadata, AttentionMetadata] | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_decode_tokens(self) -> int:
        """MIXED: the rows of the decoding sequences (the first ones); 0 otherwise."""
        return sum(self.parts[0].q_lens_cpu) if self.parts is not None else 0

    def host_state_slots(self) -> tuple[int, ...]:
        """state_slots on the host: state_slots_cpu, or (a device sync) a copy of the tensor."""
        if self.state_slots_cpu or self.state_slots is None:
            return self.state_slots_cpu
        return tuple(self.state_slots.tolist())


def _packed_metadata(
    q_lens: list[int], kv_lens: list[int], page_tables: list[list[int]], page_size: int, max_pages: int | None,
    include_table: bool = True,
) -> tuple[list[int], int, list[int]]:
    """Validated host lists -> (cu_seqlens_q + kv_lens + row-major block table + slot_mapping, table width,
    section sizes). include_table False: the table section is empty (a persistent device table holds it:
    engine/runtime/block_table.py). Pure Python: nothing touches a device."""
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
    width = max(len(p) for p in page_tables)
    if max_pages is not None:
        if max_pages < width:
            raise ValueError(f"a page table of {width} pages does not fit max_pages={max_pages}")
        width = max_pages
    table = [page for pages in page_tables for page in list(pages) + [0] * (width - len(pages))] if include_table else []
    values = cu + list(kv_lens) + table + slots
    return values, width, [len(cu), len(kv_lens), len(table), len(slots)]


@dataclass(frozen=True)
class StepLayout:
    """Where each input lives in a step's packed int64 buffer (see pack_step_inputs)."""

    sizes: tuple[int, ...]  # input_ids, positions, cu_seqlens_q, kv_lens, block_table, slot_mapping, extra
    table_width: int
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    page_size: int


def pack_step_inputs(
    input_ids: list[int],
    positions: list[int],
    q_lens: list[int],
    kv_lens: list[int],
    page_tables: list[list[int]],
    page_size: int,
    extra: list[int] = (),
    max_pages: int | None = None,
    include_table: bool = True,
) -> tuple[list[int], StepLayout]:
    """A step's host lists -> (one flat list of ints, its layout): input_ids, positions, every metadata
    tensor and `extra` (e.g. the logit rows), so the step needs ONE host-to-device copy. include_table False
    leaves the block table out (unpack_forward_batch then takes it as an argument)."""
    if len(input_ids) != len(positions) or len(input_ids) != sum(q_lens):
        raise ValueError(f"{len(input_ids)} input ids, {len(positions)} positions for q_lens summing to {sum(q_lens)}")
    values, width, sizes = _packed_metadata(q_lens, kv_lens, page_tables, page_size, max_pages, include_table)
    layout = StepLayout((len(input_ids), len(positions), *sizes, len(extra)), width, tuple(q_lens), tuple(kv_lens), page_size)
    return list(input_ids) + list(positions) + values + list(extra), layout


def unpack_forward_batch(mode: ForwardMode, packed: torch.Tensor, layout: StepLayout,
                         block_table: torch.Tensor | None = None) -> tuple[ForwardBatch, torch.Tensor]:
    """packed: [sum(layout.sizes)] int64 on the device -> (batch, extra [n] int64); views and casts only, no
    host work (a captured graph replays this after its packed buffer is overwritten). block_table
    [num_seqs, table_width] int32: the table when the packed values leave it out (include_table=False)."""
    ids, pos, cu, lens, table, slots, extra = torch.split(packed, list(layout.sizes))
    if block_table is None:
        block_table = table.to(torch.int32).view(len(layout.q_lens), layout.table_width)
    attn = AttentionMetadata(
        cu_seqlens_q=cu.to(torch.int32),
        kv_lens=lens.to(torch.int32),
        block_table=block_table,
        slot_mapping=slots,
        q_lens_cpu=layout.q_lens,
        kv_lens_cpu=layout.kv_lens,
        page_size=layout.page_size,
    )
    return ForwardBatch(mode=mode, input_ids=ids, positions=pos, attn=attn), extra


def copy_forward_batch(mode: ForwardMode, values: list[int], layout: StepLayout,
                       device: torch.device | str = "cpu") -> tuple[ForwardBatch, torch.Tensor]:
    """pack_step_inputs' output -> one step's batch with ONE host-to-device copy (pinned, non_blocking on
    a GPU). Returns (batch, extra as an int64 tensor on the device)."""
    return unpack_forward_batch(mode, host_to_device(values, torch.int64, torch.device(device)), layout)


def build_attention_metadata(
    q_lens: list[int],
    kv_lens: list[int],
    page_tables: list[list[int]],
    page_size: int,
    device: torch.device | str = "cpu",
    max_pages: int | None = None,
) -> AttentionMetadata:
    """Builds metadata for sequences whose new tokens are the last q_lens[i] of kv_lens[i] positions
    (one host-to-device copy; see copy_forward_batch)."""
    tokens = [0] * sum(q_lens)
    values, layout = pack_step_inputs(tokens, tokens, q_lens, kv_lens, page_tables, page_size, max_pages=max_pages)
    return copy_forward_batch(ForwardMode.EXTEND, values, layout, device)[0].attn
