"""The engine's plan builders are pure functions of host lists: what a prefill chunk or a decode / verify
step feeds, at which positions, into which pages, and which logits rows come back."""
from __future__ import annotations

import dataclasses

import pytest

from engine.runtime.forward_batch import ForwardMode, build_attention_metadata
from engine.runtime.step_plan import DecodeItem, PrefillItem, decode_plan, mixed_plan, prefill_plan, with_state_slots


def test_prefill_plan_feeds_each_chunk_after_its_cached_tokens():
    """Chunks of two prompts: each feeds token_ids[cached : cached + count] at those positions, its context
    ends after the chunk, and only the chunk that ends its prompt asks for a logits row (its last one)."""
    items = [PrefillItem([10, 11, 12, 13, 14], 2, 3, [4, 5], True),
             PrefillItem([20, 21, 22, 23], 0, 2, [7], False)]
    plan = prefill_plan(items, pool_names=("p0",), write_draft_context=True)
    assert plan.mode == ForwardMode.EXTEND
    assert plan.input_ids == [12, 13, 14, 20, 21] and plan.positions == [2, 3, 4, 0, 1]
    assert (plan.q_lens, plan.kv_lens) == ([3, 2], [5, 2])
    assert plan.page_tables == [[4, 5], [7]] and plan.logit_rows == [2]
    assert plan.pool_names == ("p0",) and plan.write_draft_context and plan.state_slots is None


def test_decode_plan_scores_every_fed_token():
    """A verify step: a sequence with drafts feeds [last token + drafts], a plain one its last token; every
    row's logits come back, and the state snapshot flag and state slots ride along."""
    plan = decode_plan([DecodeItem([5, 6, 7], 9, [1]), DecodeItem([8], 3, [2])], snapshot_state=True)
    assert plan.mode == ForwardMode.DECODE
    assert plan.input_ids == [5, 6, 7, 8] and plan.positions == [9, 10, 11, 3]
    assert (plan.q_lens, plan.kv_lens, plan.logit_rows) == ([3, 1], [12, 4], [0, 1, 2, 3])
    slotted = with_state_slots(plan, [4, 6], (6,))
    assert slotted.state_slots == [4, 6] and slotted.reset_slots == (6,) and slotted.snapshot_state
    assert plan.state_slots is None  # the original plan is unchanged


def test_mixed_plan_puts_the_decoding_rows_first():
    """A mixed step: two decoding sequences (one token each) then a prefill chunk; every decoding row's logits and
    the chunk's last row come back, counted in the whole plan's rows. Drafts, or no decoding sequence, are refused."""
    plan = mixed_plan([DecodeItem([5], 9, [1, 2]), DecodeItem([8], 3, [3])],
                      [PrefillItem([20, 21, 22, 23], 1, 3, [7], True)], keys=["a", "b", "c"])
    assert plan.mode == ForwardMode.MIXED and plan.decode_seqs == 2 and plan.seq_keys == ("a", "b", "c")
    assert plan.input_ids == [5, 8, 21, 22, 23] and plan.positions == [9, 3, 1, 2, 3]
    assert (plan.q_lens, plan.kv_lens, plan.logit_rows) == ([1, 1, 3], [10, 4, 4], [0, 1, 4])
    with pytest.raises(ValueError, match="one token each"):
        mixed_plan([DecodeItem([5, 6], 9, [1, 2])], [PrefillItem([1, 2], 0, 2, [7], True)])
    with pytest.raises(ValueError, match="decode_seqs"):
        dataclasses.replace(plan, decode_seqs=0)


def test_attention_metadata_splits_into_two_batches_of_their_own():
    """split(k): the first k sequences and the rest, each with query rows counted from 0 and its own slots."""
    attn = build_attention_metadata([1, 1, 3], [10, 4, 4], [[1, 2, 5], [3], [7]], 4)
    head, tail = attn.split(2)
    assert head.cu_seqlens_q.tolist() == [0, 1, 2] and tail.cu_seqlens_q.tolist() == [0, 3]
    assert head.kv_lens_cpu == (10, 4) and tail.q_lens_cpu == (3,) and tail.kv_lens.tolist() == [4]
    assert head.slot_mapping.tolist() == [5 * 4 + 1, 3 * 4 + 3] and tail.slot_mapping.tolist() == [29, 30, 31]
    assert tail.block_table.tolist() == [[7, 0, 0]]
    with pytest.raises(ValueError):
        attn.split(3)
