"""Graph bucket choice and padding: which captured graph a step uses and what its dummy rows touch."""
from __future__ import annotations

import pytest

from engine.runtime.forward_batch import ForwardMode
from engine.runtime.graph_buckets import bucket_for, graph_buckets, pad_target_plan, uniform_query_len
from engine.runtime.step_plan import TargetPlan, pack_target_plan


def _decode_plan(q_len: int, kv_lens: list[int], tables: list[list[int]]) -> TargetPlan:
    ids, positions = [], []
    for kv in kv_lens:
        ids += list(range(100, 100 + q_len))
        positions += list(range(kv - q_len, kv))
    return TargetPlan(ForwardMode.DECODE, ids, positions, [q_len] * len(kv_lens), kv_lens, tables,
                      list(range(len(ids))), None, True)


def test_buckets_cover_every_batch_size():
    """Buckets start 1, 2, 4, 8, step by 8, end at max_batch; every n <= max gets the smallest bucket >= n."""
    buckets = graph_buckets(64)
    assert buckets == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert graph_buckets(12) == (1, 2, 4, 8, 12) and graph_buckets(1) == (1,)
    for n in range(1, 65):
        chosen = bucket_for(n, buckets)
        assert chosen >= n and all(b < n for b in buckets if b < chosen)
    assert bucket_for(65, buckets) is None
    with pytest.raises(ValueError):
        graph_buckets(0)


def test_padding_keeps_real_rows_and_isolates_dummies():
    """Real sequences come first, unchanged; dummies write and read only the scratch page."""
    plan = _decode_plan(3, [10, 5], [[0, 1], [2]])
    padded = pad_target_plan(plan, bucket=4, scratch_page=9, page_size=8)
    assert padded.q_lens == [3] * 4 and padded.kv_lens == [10, 5, 3, 3]
    assert padded.input_ids[:6] == plan.input_ids and padded.positions[:6] == plan.positions
    assert padded.page_tables[:2] == [[0, 1], [2]] and padded.page_tables[2:] == [[9], [9]]
    assert padded.logit_rows == list(range(12)) and padded.write_draft_context
    values, layout = pack_target_plan(padded, 8, max_pages=4)
    slots = values[sum(layout.sizes[:5]) : sum(layout.sizes[:6])]
    assert all(9 * 8 <= s < 10 * 8 for s in slots[6:])  # dummy tokens land in the scratch page only
    assert all(s < 9 * 8 for s in slots[:6])


def test_dummy_block_longer_than_a_page_wraps_in_the_scratch_page():
    """A verify block longer than a page still only touches the one scratch page."""
    plan = _decode_plan(6, [6], [[0, 1]])
    padded = pad_target_plan(plan, bucket=2, scratch_page=5, page_size=4)
    assert padded.page_tables[1] == [5, 5]


def test_only_uniform_decode_plans_are_graphable():
    """Prefill, mixed query lengths, partial logit rows and foreign pools run eagerly."""
    plan = _decode_plan(1, [4, 7], [[0], [1]])
    assert uniform_query_len(plan) == 1
    mixed = TargetPlan(ForwardMode.DECODE, [1, 2, 3], [3, 6, 7], [1, 2], [4, 8], [[0], [1]], [0, 1, 2])
    assert uniform_query_len(mixed) is None
    prefill = TargetPlan(ForwardMode.EXTEND, [1, 2], [0, 1], [2], [2], [[0]], [0, 1])
    assert uniform_query_len(prefill) is None
    partial = TargetPlan(ForwardMode.DECODE, [1, 2], [3, 6], [1, 1], [4, 7], [[0], [1]], [1])
    assert uniform_query_len(partial) is None
    with pytest.raises(ValueError, match="do not fit"):
        pad_target_plan(plan, bucket=1, scratch_page=3, page_size=4)
