"""Step plans: what the leader broadcasts to every tensor-parallel rank before each forward.

Plain picklable dataclasses of Python lists, so a follower rebuilds exactly the leader's batch."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

from engine.runtime.forward_batch import ForwardMode, StepLayout, pack_step_inputs


@dataclass(frozen=True)
class TargetPlan:
    """One target-model forward. Sequence i feeds q_lens[i] tokens ending its context of kv_lens[i].

    logit_rows: token rows (indices into input_ids) whose logits the leader needs.
    pool_names: per-rank shared-memory pools to use as the cache (None: the rank's own cache).
    write_draft_context: also store the draft model's context entries for every token.
    state_slots: the state-pool slot of each sequence (models with linear attention; None otherwise).
    reset_slots: slots every rank zeroes before the forward (sequences starting from token 0).
    snapshot_state: a speculative verify step: KDA state per position goes to the scratch, slots are
        kept until a CommitStatePlan names how many positions each sequence keeps.
    seq_keys: which sequence each row is (its request id), so that tensor-parallel followers receive page-table
        deltas instead of whole tables (engine/runtime/page_table_sync.py); None: the tables travel whole.
    decode_seqs: MIXED: the first decode_seqs sequences decode (one token each), the rest are prefill chunks.
    """

    mode: ForwardMode
    input_ids: list[int]
    positions: list[int]
    q_lens: list[int]
    kv_lens: list[int]
    page_tables: list[list[int]]
    logit_rows: list[int]
    pool_names: tuple[str, ...] | None = None
    write_draft_context: bool = False
    state_slots: list[int] | None = None
    reset_slots: tuple[int, ...] = ()
    snapshot_state: bool = False
    seq_keys: tuple[str, ...] | None = None
    decode_seqs: int = 0

    def __post_init__(self) -> None:
        if self.mode == ForwardMode.MIXED and not (0 < self.decode_seqs < len(self.q_lens)
                                                   and all(n == 1 for n in self.q_lens[: self.decode_seqs])):
            raise ValueError(f"a MIXED plan needs 1 <= decode_seqs < {len(self.q_lens)} one-token sequences first, "
                             f"got decode_seqs={self.decode_seqs}")


class PrefillItem(NamedTuple):
    """One sequence's share of a prefill forward: token_ids[num_cached : num_cached + num_tokens] into pages."""

    token_ids: list[int]
    num_cached: int
    num_tokens: int
    pages: list[int]
    needs_logits: bool  # the chunk ends the prompt: its last row's logits choose the first token
    all_logits: bool = False  # every row's logits (prompt scoring: engine/sampling/prompt_logprobs.py)


class DecodeItem(NamedTuple):
    """One sequence in a decode / verify forward: `tokens` (last token + drafts) after num_cached tokens."""

    tokens: list[int]
    num_cached: int
    pages: list[int]


def _keys(keys, items) -> tuple[str, ...] | None:
    if keys is None:
        return None
    keys = tuple(keys)
    if len(keys) != len(items):
        raise ValueError(f"{len(keys)} sequence keys for {len(items)} items")
    return keys


def prefill_plan(items: list[PrefillItem], pool_names: tuple[str, ...] | None = None,
                 write_draft_context: bool = False, keys: list[str] | None = None) -> TargetPlan:
    """An EXTEND plan over chunks of several prompts; logit_rows: every row of an all_logits item, else the last
    row of each item needing logits. keys: each item's sequence (TargetPlan.seq_keys)."""
    input_ids: list[int] = []
    positions: list[int] = []
    rows: list[int] = []
    for item in items:
        end = item.num_cached + item.num_tokens
        input_ids.extend(item.token_ids[item.num_cached : end])
        positions.extend(range(item.num_cached, end))
        if item.all_logits:
            rows.extend(range(len(input_ids) - item.num_tokens, len(input_ids)))
        elif item.needs_logits:
            rows.append(len(input_ids) - 1)
    return TargetPlan(
        mode=ForwardMode.EXTEND, input_ids=input_ids, positions=positions, q_lens=[item.num_tokens for item in items],
        kv_lens=[item.num_cached + item.num_tokens for item in items], page_tables=[list(item.pages) for item in items],
        logit_rows=rows, pool_names=pool_names, write_draft_context=write_draft_context, seq_keys=_keys(keys, items),
    )


def decode_plan(items: list[DecodeItem], write_draft_context: bool = False, snapshot_state: bool = False,
                keys: list[str] | None = None) -> TargetPlan:
    """A DECODE plan (speculative verify when items carry drafts): logits for every fed token. keys: each item's
    sequence (TargetPlan.seq_keys)."""
    input_ids: list[int] = []
    positions: list[int] = []
    for item in items:
        input_ids.extend(item.tokens)
        positions.extend(range(item.num_cached, item.num_cached + len(item.tokens)))
    return TargetPlan(
        mode=ForwardMode.DECODE, input_ids=input_ids, positions=positions, q_lens=[len(item.tokens) for item in items],
        kv_lens=[item.num_cached + len(item.tokens) for item in items], page_tables=[list(item.pages) for item in items],
        logit_rows=list(range(len(input_ids))), write_draft_context=write_draft_context, snapshot_state=snapshot_state,
        seq_keys=_keys(keys, items),
    )


def mixed_plan(decoding: list[DecodeItem], chunks: list[PrefillItem], write_draft_context: bool = False,
               keys: list[str] | None = None) -> TargetPlan:
    """One MIXED forward: decoding sequences (one token each, no drafts) and then prefill chunks. logit_rows: every
    decoding row, then the prefill chunks' (as prefill_plan's). keys: each item's sequence, decoding ones first."""
    if any(len(item.tokens) != 1 for item in decoding):
        raise ValueError("a mixed step's decoding sequences feed one token each (no drafts)")
    head = decode_plan(decoding, write_draft_context)
    tail = prefill_plan(chunks, write_draft_context=write_draft_context)
    width = len(head.input_ids)
    return TargetPlan(
        mode=ForwardMode.MIXED, input_ids=head.input_ids + tail.input_ids, positions=head.positions + tail.positions,
        q_lens=head.q_lens + tail.q_lens, kv_lens=head.kv_lens + tail.kv_lens,
        page_tables=head.page_tables + tail.page_tables,
        logit_rows=head.logit_rows + [width + row for row in tail.logit_rows], write_draft_context=write_draft_context,
        seq_keys=_keys(keys, decoding + chunks), decode_seqs=len(decoding),
    )


def with_state_slots(plan: TargetPlan, slots: list[int], fresh: tuple[int, ...]) -> TargetPlan:
    """The plan with each sequence's state-pool slot; `fresh` slots (sequences starting at token 0) are
    zeroed by every rank before the forward."""
    return dataclasses.replace(plan, state_slots=list(slots), reset_slots=tuple(fresh))


def pack_target_plan(plan: TargetPlan, page_size: int, max_pages: int | None = None,
                     include_table: bool = True) -> tuple[list[int], StepLayout]:
    """The plan's tokens, attention metadata and logit rows as one flat list of ints and its layout
    (forward_batch.pack_step_inputs): what one host-to-device copy moves."""
    return pack_step_inputs(plan.input_ids, plan.positions, plan.q_lens, plan.kv_lens, plan.page_tables, page_size,
                            plan.logit_rows, max_pages, include_table)


@dataclass(frozen=True)
class DraftPlan:
    """One draft forward: block [last token, MASK x (block_size - 1)] per sequence, starting at
    position context_lens[i] (the context covers positions 0 .. context_lens[i] - 1)."""

    block_size: int
    last_tokens: list[int]
    context_lens: list[int]
    page_tables: list[list[int]]
    with_hidden: bool = False  # also return the draft's hidden states (a gated / rnn DSpark Markov head reads them)
    seq_keys: tuple[str, ...] | None = None  # each row's sequence, as TargetPlan.seq_keys


@dataclass(frozen=True)
class CommitStatePlan:
    """After a verify step: slot slots[i] takes the KDA state after verify position steps[i] of the
    step's sequence i (steps[i] = tokens kept - 1; -1 leaves the slot as it was)."""

    slots: list[int]
    steps: list[int]


@dataclass(frozen=True)
class CheckpointStatePlan:
    """Prefix cache, models with KDA layers: every rank copies whole state slots between its state pool and its
    checkpoint pool. save: state slot pairs[i][0] -> checkpoint pairs[i][1]; otherwise (restore) checkpoint
    pairs[i][0] -> state slot pairs[i][1] (in the pools named by pool_names; None: the rank's own)."""

    pairs: list[tuple[int, int]]
    save: bool
    pool_names: tuple[str, ...] | None = None


@dataclass(frozen=True)
class SnapshotCheckpointPlan:
    """Prefix cache, right after a speculative verify step's commit: checkpoint rows[i][2] takes the KDA state
    after verify position rows[i][1] of the step's sequence rows[i][0] (a page boundary inside the kept tokens)."""

    rows: list[tuple[int, int, int]]


@dataclass(frozen=True)
class ExportPlan:
    """A prefill-only sequence is done: every rank copies its own pages src_pages[i] -> dst_pages[i] (target and
    draft context) and its state slot src_slot -> dst_slot (models with linear attention) into the pools named
    (None: its own pool)."""

    src_pages: list[int]
    dst_pages: list[int]
    pool_names: tuple[str, ...] | None
    src_slot: int | None = None
    dst_slot: int | None = None


@dataclass(frozen=True)
class ReadStatePlan:
    """Every rank contributes its copy of one state slot (its KDA heads' share); the leader gets them
    all, rank order: uint8 [tp_size, slot bytes] (a prefill handoff sends row r to decode rank r)."""

    slot: int


@dataclass(frozen=True)
class AttachPoolsPlan:
    """Every rank maps its shared-memory pool (rank r takes pool_names[r])."""

    pool_names: tuple[str, ...]


@dataclass(frozen=True)
class ShutdownPlan:
    """Followers leave their loop."""
