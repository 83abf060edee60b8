"""Page-table deltas for tensor-parallel followers (engine/runtime/page_table_sync.py), host logic only.

Invariants: whatever the engine does to page lists (append, truncate, release, replace by a prefix-cache hit,
new sequences, rows reordered, keys shared or idle), every follower rebuilds exactly the leader's tables; a
plain decode step at a long context pickles a small fraction of the whole tables; a corrupted, lost or repeated
delta is refused (PageTableDesync) rather than rebuilt into a wrong table, and a reset brings a follower back."""
from __future__ import annotations

import dataclasses
import logging
import pickle
import random

import pytest

from engine.runtime.forward_batch import ForwardMode
from engine.runtime.page_table_sync import (DeltaPlan, PageTableDesync, PageTableReceiver, PageTableSender, TableDelta,
                                            from_wire, to_wire)
from engine.runtime.step_plan import DecodeItem, DraftPlan, TargetPlan, decode_plan

logger = logging.getLogger(__name__)


def _random_steps(seed: int, steps: int):
    """(keys, page_tables) per step: sequences come and go, grow, shrink after rejected drafts, are preempted
    (empty, then new pages), take a prefix-cache hit (a new list sharing the first pages of another) and appear in
    any order, sometimes twice in one plan."""
    rng = random.Random(seed)
    live: dict[str, list[int]] = {}
    next_page = 0
    for step in range(steps):
        for key in list(live):
            action = rng.random()
            if action < 0.3:
                live[key].extend(range(next_page, next_page + rng.randint(1, 3)))
                next_page += 3
            elif action < 0.4 and live[key]:
                del live[key][rng.randint(0, len(live[key]) - 1):]
            elif action < 0.45:
                live[key] = []  # preempted
            elif action < 0.5:
                other = rng.choice(list(live.values()))
                live[key] = other[: rng.randint(0, len(other))] + [next_page]  # a prefix-cache hit
                next_page += 1
            elif action < 0.55:
                del live[key]  # finished
        for _ in range(rng.randint(0, 3)):
            key = f"r{step}-{rng.randint(0, 999)}"
            live[key] = list(range(next_page, next_page + rng.randint(0, 5)))
            next_page += 5
        if not live:
            continue
        keys = rng.sample(sorted(live), rng.randint(1, len(live)))
        if rng.random() < 0.1:
            keys.append(keys[0])  # the same sequence twice in one plan (a draft row and its target row)
        yield keys, [list(live[key]) for key in keys]


@pytest.mark.parametrize("seed", range(5))
def test_followers_rebuild_exactly_the_leaders_tables(seed):
    sender, receiver = PageTableSender(max_idle=4), PageTableReceiver()
    steps = 0
    for keys, tables in _random_steps(seed, 400):
        delta = pickle.loads(pickle.dumps(sender.encode(keys, tables)))
        assert receiver.decode(delta) == tables
        steps += 1
    assert steps > 300
    assert sender.mirrored < 60  # idle sequences were forgotten on both sides


def _long_context_decode(batch: int, pages: int) -> tuple[list[str], list[list[int]]]:
    keys = [f"request-{i:04d}-{'x' * 20}" for i in range(batch)]
    return keys, [list(range(i * pages, (i + 1) * pages)) for i in range(batch)]


def _plan(keys: list[str], tables: list[list[int]], num_cached: int) -> TargetPlan:
    items = [DecodeItem([7], num_cached, pages) for pages in tables]
    return decode_plan(items, keys=keys)


def test_a_plain_decode_step_at_a_long_context_pickles_a_small_fraction():
    """Batch 64 x 10,240 pages (163,840 positions in 16-token pages, the issue's DeepSeek-V3 figure): after the
    first step, a decode step in which 4 sequences cross a page boundary pickles >= 500x fewer bytes than the
    whole plan (measured: bytes, not time)."""
    batch, pages, page_size = 64, 10_240, 16
    keys, tables = _long_context_decode(batch, pages)
    sender, receiver = PageTableSender(), PageTableReceiver()
    first = _plan(keys, tables, pages * page_size - 1)
    assert from_wire(receiver, pickle.loads(pickle.dumps(to_wire(sender, first)))) == dataclasses.replace(
        first, seq_keys=None)
    next_page = batch * pages
    for row in (3, 17, 40, 63):
        tables[row].append(next_page)
        next_page += 1
    step = _plan(keys, tables, pages * page_size)
    whole = len(pickle.dumps(step))
    wire = pickle.dumps(to_wire(sender, step))
    rebuilt = from_wire(receiver, pickle.loads(wire))
    assert rebuilt.page_tables == step.page_tables and rebuilt.input_ids == step.input_ids
    ratio = whole / len(wire)
    logger.info("plain decode step, batch %d x %d pages: whole plan %d B, delta plan %d B (%.0fx fewer)",
                batch, pages, whole, len(wire), ratio)
    print(f"\npickled bytes per plain decode step, batch {batch} x {pages} pages: whole {whole} B, "
          f"delta {len(wire)} B, ratio {ratio:.0f}x")
    assert whole > 2_000_000 and ratio >= 500
    assert sender.pages_sent == batch * pages + 4


def test_plans_without_sequence_keys_travel_whole():
    sender = PageTableSender()
    plan = TargetPlan(ForwardMode.EXTEND, [1, 2], [0, 1], [2], [2], [[5]], [1])
    assert to_wire(sender, plan) is plan and from_wire(PageTableReceiver(), plan) is plan
    draft = DraftPlan(4, [3], [9], [[1, 2]], seq_keys=("a",))
    wire = to_wire(sender, draft)
    assert isinstance(wire, DeltaPlan) and wire.plan.page_tables == [] and wire.plan.seq_keys is None


def _synced_pair():
    sender, receiver = PageTableSender(), PageTableReceiver()
    keys, tables = ["a", "b"], [[1, 2, 3], [4, 5]]
    assert receiver.decode(sender.encode(keys, tables)) == tables
    tables[0].append(6)
    return sender, receiver, keys, tables


def test_a_corrupted_delta_is_refused():
    """Negative control: an appended page changed in transit (the checksum no longer matches) is refused, and
    so is every later delta until the leader resyncs; the resync rebuilds the right tables."""
    sender, receiver, keys, tables = _synced_pair()
    good = sender.encode(keys, tables)
    handle, keep, tail = good.edits[0]
    corrupted = TableDelta(good.epoch, good.reset, good.handles, ((handle, keep, (tail[0] + 1,)),), good.drops,
                           good.checksum)
    with pytest.raises(PageTableDesync, match="checksum"):
        receiver.decode(corrupted)
    tables[1].append(7)
    with pytest.raises(PageTableDesync, match="lost or repeated"):
        receiver.decode(sender.encode(keys, tables))  # a correct delta after a refused one: still refused
    sender.resync()
    again = sender.encode(keys, tables)
    assert again.reset and receiver.decode(again) == tables


def test_a_lost_or_repeated_delta_is_refused():
    sender, receiver, keys, tables = _synced_pair()
    sender.encode(keys, tables)  # never arrives
    tables[1].append(9)
    with pytest.raises(PageTableDesync, match="lost or repeated"):
        receiver.decode(sender.encode(keys, tables))
    sender2, receiver2, keys2, tables2 = _synced_pair()
    delta = sender2.encode(keys2, tables2)
    assert receiver2.decode(delta) == tables2
    with pytest.raises(PageTableDesync, match="lost or repeated"):
        receiver2.decode(delta)


def test_a_delta_naming_an_unknown_sequence_or_keeping_too_much_is_refused():
    sender, receiver, keys, tables = _synced_pair()
    good = sender.encode(keys, tables)
    with pytest.raises(PageTableDesync, match="does not hold"):
        receiver.decode(TableDelta(good.epoch, False, good.handles + (99,), good.edits, (), good.checksum))
    receiver = PageTableReceiver()
    sender.resync()
    first = sender.encode(keys, tables)
    receiver.decode(first)
    with pytest.raises(PageTableDesync, match="keeps 10 pages"):
        receiver.decode(TableDelta(first.epoch + 1, False, first.handles, ((first.handles[0], 10, (1,)),), (),
                                   first.checksum))


def test_a_follower_that_joins_late_needs_a_reset():
    sender, _, keys, tables = _synced_pair()
    late = PageTableReceiver()
    with pytest.raises(PageTableDesync):
        late.decode(sender.encode(keys, tables))
    sender.invalidate()
    assert late.decode(sender.encode(keys, tables)) == tables
