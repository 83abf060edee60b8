"""The persistent device block table of captured steps (engine/runtime/block_table.py) and the graph runner's host
side (engine/runtime/cuda_graphs.py): after every update the device table holds exactly the rows' page lists, only
changed entries travel, a padded step unpacks to the same metadata as the eager packing, and which graph
buckets exist is agreed across tensor-parallel ranks."""
from __future__ import annotations

import random

import pytest
import torch

from engine.runtime.block_table import DeviceBlockTable
from engine.runtime.cuda_graphs import agree_across_ranks, pad_step
from engine.runtime.distributed import TPGroup
from engine.runtime.forward_batch import ForwardMode, unpack_forward_batch
from engine.runtime.graph_buckets import pad_target_plan
from engine.runtime.step_plan import DecodeItem, decode_plan, pack_target_plan


def _assert_holds(table: DeviceBlockTable, page_tables: list[list[int]]) -> None:
    for row, pages in enumerate(page_tables):
        assert table.table[row, : len(pages)].tolist() == pages, f"row {row}"


def test_decode_steps_write_only_new_pages():
    """Rows that keep their sequence write one entry when it crosses a page boundary and none otherwise; the
    first update writes everything; the device table always holds every row's pages."""
    table = DeviceBlockTable(rows=4, width=64, device=torch.device("cpu"))
    rows = [[7, 3, 9], [12], [40, 41, 42, 43, 44]]
    assert table.update(rows) == 9
    _assert_holds(table, rows)
    assert table.update(rows) == 0  # nothing changed: nothing travels
    rows[1].append(13)
    assert table.update(rows) == 1
    _assert_holds(table, rows)


def test_changed_rows_are_rewritten_whole():
    """A row that changes hands (different first page), a copy-on-write of the last page, a shrink
    (speculative rollback) and regrowth each leave the device row equal to the new list."""
    table = DeviceBlockTable(rows=3, width=16, device=torch.device("cpu"))
    table.update([[1, 2, 3], [4, 5], [6]])
    rows = [[8, 2, 3], [4, 9], [6]]  # row 0: a new sequence; row 1: its last page copied on write
    assert table.update(rows) == 3 + 2  # both rows rewritten whole
    _assert_holds(table, rows)
    rows = [[8, 2], [4, 9], [6]]  # row 0 shrinks
    assert table.update(rows) == 0
    rows = [[8, 2, 11, 12], [4, 9], [6]]  # ... and grows again with other pages
    assert table.update(rows) == 2
    _assert_holds(table, rows)


def test_random_histories_match_a_full_rewrite():
    """Property: over random append / replace / shrink / copy-on-write histories, the delta-updated device
    table equals the table written from scratch, on every row's used prefix."""
    generator = random.Random(0)
    table = DeviceBlockTable(rows=8, width=32, device=torch.device("cpu"))
    rows = [[generator.randrange(1000)] for _ in range(8)]
    for _ in range(300):
        row = generator.randrange(8)
        action = generator.random()
        if action < 0.5 and len(rows[row]) < 32:
            rows[row].append(generator.randrange(1000))
        elif action < 0.65:
            rows[row] = [generator.randrange(1000) for _ in range(generator.randrange(1, 10))]
        elif action < 0.8 and len(rows[row]) > 1:
            del rows[row][generator.randrange(1, len(rows[row])):]
        else:
            rows[row][-1] = generator.randrange(1000)
        count = generator.randrange(1, 9)
        table.update(rows[:count])
        _assert_holds(table, rows[:count])


def test_a_table_wider_than_the_graphs_is_refused():
    """More pages than the captured width is an error, not a silent truncation."""
    table = DeviceBlockTable(rows=2, width=4, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="does not fit width 4"):
        table.update([[1, 2, 3, 4, 5]])


def test_padded_step_unpacks_to_the_eager_metadata():
    """A step packed without its table and read with the persistent table gives the same input ids,
    positions, lengths, slots, logit rows and block table as the old full packing of the padded plan."""
    plan = decode_plan([DecodeItem([5], 17, [3, 8]), DecodeItem([6], 4, [9]), DecodeItem([2], 31, [1, 4])])
    bucket, scratch, page_size, max_pages = 4, 99, 16, 6
    padded = pad_step(plan, bucket, scratch, page_size, max_pages)
    table = DeviceBlockTable(rows=8, width=max_pages, device=torch.device("cpu"))
    table.update(padded.page_tables)
    batch, rows = unpack_forward_batch(ForwardMode.DECODE, torch.tensor(padded.values), padded.layout,
                                       table.table[:bucket])
    values, layout = pack_target_plan(pad_target_plan(plan, bucket, scratch, page_size), page_size, max_pages)
    expected, expected_rows = unpack_forward_batch(ForwardMode.DECODE, torch.tensor(values), layout)
    for name in ("cu_seqlens_q", "kv_lens", "slot_mapping"):
        assert torch.equal(getattr(batch.attn, name), getattr(expected.attn, name)), name
    assert torch.equal(batch.input_ids, expected.input_ids) and torch.equal(batch.positions, expected.positions)
    assert torch.equal(rows, expected_rows)
    for row, pages in enumerate(padded.page_tables):  # past a row's pages the old table had zeros: never read
        used = len(pages)
        assert batch.attn.block_table[row, :used].tolist() == expected.attn.block_table[row, :used].tolist()
    assert len(padded.values) == len(values) - bucket * max_pages  # the table no longer travels per step


class _OtherRanks(TPGroup):
    """A TP group of `size` ranks whose all_reduce adds the other ranks' flags (one failed capture each)."""

    def __init__(self, size: int, others: list[list[int]]) -> None:
        super().__init__(rank=0, size=size)
        object.__setattr__(self, "others", others)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        for flags in self.others:
            x += torch.tensor(flags, dtype=x.dtype)
        return x


def test_graph_buckets_are_agreed_across_ranks():
    """A bucket whose capture failed on ANY rank is dropped on every rank (each rank then runs that batch
    size eagerly with the same all-reduces); one rank alone keeps what it captured."""
    keys = [(1, 1), (2, 1), (4, 1), (8, 1)]
    mine = {(1, 1), (2, 1), (8, 1)}  # (4, 1) failed here
    other = [1, 1, 1, 0]  # (8, 1) failed on rank 1
    agreed = agree_across_ranks(keys, mine, _OtherRanks(2, [other]), torch.device("cpu"))
    assert agreed == {(1, 1), (2, 1)}
    assert agree_across_ranks(keys, mine, TPGroup(), torch.device("cpu")) == mine


def _agree_on_rank(rank: int, store_path: str, failed: list, out_dir: str) -> None:
    import json
    import os

    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    try:
        keys = [(1, 1), (2, 1), (4, 1), (8, 1)]
        captured = {key for key in keys if key != tuple(failed[rank])}
        agreed = agree_across_ranks(keys, captured, TPGroup(rank, 2), torch.device("cpu"))
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(sorted(agreed), f)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two gloo processes: ~5 s of CPU
def test_graph_buckets_are_agreed_over_a_real_process_group(tmp_path):
    """Over a real two-rank gloo group, rank 0 failing bucket 4 and rank 1 failing bucket 8 leaves both ranks
    with exactly buckets 1 and 2 (the same set on each: no rank replays a graph the other runs eagerly)."""
    import json

    import torch.multiprocessing as mp

    mp.start_processes(_agree_on_rank, args=(str(tmp_path / "store"), [(4, 1), (8, 1)], str(tmp_path)), nprocs=2,
                       start_method="spawn")
    for rank in range(2):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == [[1, 1], [2, 1]]
