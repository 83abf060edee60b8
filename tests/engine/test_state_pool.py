"""The per-sequence state pool: geometry, zeroed allocation, free-list accounting."""
from __future__ import annotations

import pytest
import torch

from engine.cache.state_pool import OutOfStateSlots, StatePool, StateShape


def _shape(**overrides) -> StateShape:
    values = dict(num_kda_layers=2, num_slots=3, conv_width=3, conv_channels=24, num_heads=2, head_k_dim=4,
                  head_v_dim=4, conv_dtype=torch.bfloat16, ssm_dtype=torch.float32)
    values.update(overrides)
    return StateShape(**values)


def test_tensor_shapes_and_bytes_per_slot():
    """Pool tensors follow the agreed layout; bytes_per_slot counts conv and recurrent of every layer."""
    pool = StatePool(_shape())
    assert pool.conv.shape == (2, 3, 3, 24) and pool.conv.dtype == torch.bfloat16
    assert pool.recurrent.shape == (2, 3, 2, 4, 4) and pool.recurrent.dtype == torch.float32
    assert pool.shape.bytes_per_slot == 2 * 3 * 24 * 2 + 2 * 2 * 4 * 4 * 4


def test_k3_tp8_bytes_per_slot_matches_spec():
    """K3 at TP8 (69 KDA layers, 12 heads, 128x128, bf16 conv, fp32 SSM) takes 56,171,520 B per request."""
    shape = StateShape(num_kda_layers=69, num_slots=1, conv_width=3, conv_channels=3 * 12 * 128, num_heads=12,
                       head_k_dim=128, head_v_dim=128, conv_dtype=torch.bfloat16, ssm_dtype=torch.float32)
    assert shape.bytes_per_slot == 56_171_520


def test_alloc_zeroes_and_free_returns_slot():
    """A slot comes back zeroed even after a previous owner wrote into it; num_free tracks alloc/free."""
    pool = StatePool(_shape())
    slot = pool.alloc()
    assert pool.num_free == 2
    pool.conv[:, slot] = 1.0
    pool.recurrent[:, slot] = 2.0
    pool.free(slot)
    assert pool.num_free == 3
    again = pool.alloc()
    assert again == slot
    assert pool.conv[:, again].abs().sum() == 0 and pool.recurrent[:, again].abs().sum() == 0


def test_exhaustion_and_double_free_raise():
    """Allocating past the pool raises OutOfStateSlots; freeing a slot twice raises ValueError."""
    pool = StatePool(_shape(num_slots=1))
    slot = pool.alloc()
    with pytest.raises(OutOfStateSlots):
        pool.alloc()
    pool.free(slot)
    with pytest.raises(ValueError, match="not allocated"):
        pool.free(slot)


@pytest.mark.parametrize("field,value", [("num_heads", 0), ("conv_channels", 25), ("num_slots", -1)])
def test_bad_shape_names_field(field, value):
    """A bad geometry is a ValueError naming the field."""
    with pytest.raises(ValueError, match=field):
        _shape(**{field: value})


def test_slot_round_trip():
    """write_slot then read_slot returns the same tensors."""
    pool = StatePool(_shape())
    slot = pool.alloc()
    conv = torch.randn(2, 3, 24).to(torch.bfloat16)
    recurrent = torch.randn(2, 2, 4, 4)
    pool.write_slot(slot, conv, recurrent)
    got_conv, got_rec = pool.read_slot(slot)
    assert torch.equal(got_conv, conv) and torch.equal(got_rec, recurrent)


def test_split_memory_budget():
    """Slots = max_running + 1 within half the budget, pages take the rest; no slots without linear attention."""
    from engine.cache.state_pool import split_memory_budget

    assert split_memory_budget(10_000, 100, 0, 4) == (100, 0, 0, 0)
    assert split_memory_budget(10_000, 100, 1000, 4) == (50, 5, 0, 0)
    assert split_memory_budget(10_000, 100, 2000, 4) == (60, 2, 0, 0)  # capped at half the budget
    with pytest.raises(ValueError, match="kv_memory_bytes"):
        split_memory_budget(1000, 100, 600, 4)


@pytest.mark.parametrize("budget,max_running,steps,fraction", [
    (100_000, 4, 3, 0.5), (100_000, 64, 8, 0.5), (37_000, 4, 2, 0.5), (1_000_000, 3, 8, 0.95), (20_000, 8, 4, 0.9),
])
def test_split_memory_budget_counts_verify_scratch(budget, max_running, steps, fraction):
    """With speculation, pages + slots + the scratch for every running sequence (rows x steps slots' worth)
    never exceed the budget, state stays within its fraction, and every running sequence gets a scratch row."""
    from engine.cache.state_pool import split_memory_budget

    page, slot = 100, 1000
    split = split_memory_budget(budget, page, slot, max_running, snapshot_steps=steps, state_fraction=fraction)
    state = (split.num_slots + split.snapshot_rows * split.snapshot_steps) * slot
    assert split.num_pages * page + state <= budget
    assert state <= budget * fraction
    assert split.snapshot_steps == steps and split.snapshot_rows == min(max_running, split.num_slots)
    plain = split_memory_budget(budget, page, slot, max_running, state_fraction=fraction)
    assert plain.num_pages * page + plain.num_slots * slot + min(max_running, plain.num_slots) * steps * slot > budget


def test_split_memory_budget_exact_figures():
    """4 running, 3 verify positions, slot 1000 B in half of 100 kB: 5 slots + 4 x 3 scratch = 17 kB of state,
    the pages get the other 83 kB; with 8 positions in half of 20 kB only one slot + its scratch fit; a budget
    too small for one slot and its scratch is refused."""
    from engine.cache.state_pool import split_memory_budget

    assert split_memory_budget(100_000, 100, 1000, 4, snapshot_steps=3) == (830, 5, 4, 3)
    assert split_memory_budget(20_000, 100, 1000, 4, snapshot_steps=8) == (110, 1, 1, 8)  # 1 + 8 slots in 10 kB
    with pytest.raises(ValueError, match="verify scratch"):
        split_memory_budget(20_000, 100, 1000, 4, snapshot_steps=10)
    with pytest.raises(ValueError, match="state_fraction"):
        split_memory_budget(10_000, 100, 1000, 4, state_fraction=1.0)


def test_scheduler_waits_for_a_free_slot_and_frees_on_preemption():
    """A waiting sequence gets no prefill chunk while every slot is taken; dropping a sequence's cache
    (preemption) returns its slot, and the next sequence then takes it."""
    from engine.cache.kv_cache import PageAllocator, PageTable
    from engine.sampling_params import SamplingParams
    from engine.runtime.scheduler import Scheduler, SchedulerConfig
    from engine.runtime.sequence import Sequence

    pool = StatePool(_shape(num_slots=1))
    allocator = PageAllocator(16)
    scheduler = Scheduler(SchedulerConfig(max_running=4, max_batched_tokens=64), allocator, pool)
    seqs = [Sequence(f"r{i}", 5, [1, 2, 3, 4, 5], SamplingParams(), PageTable(allocator, 4), arrival_order=i)
            for i in range(2)]
    for seq in seqs:
        scheduler.add(seq)
    step = scheduler.schedule()
    assert [chunk.seq for chunk in step.prefill] == [seqs[0]] and seqs[0].state_slot == 0 and pool.num_free == 0
    scheduler.drop_cache(seqs[0])
    assert seqs[0].state_slot is None and pool.num_free == 1 and seqs[0].num_cached == 0
    scheduler.remove(seqs[0])
    step = scheduler.schedule()
    assert [chunk.seq for chunk in step.prefill] == [seqs[1]] and seqs[1].state_slot == 0


def test_commit_snapshots_picks_each_rows_step():
    """commit_snapshots copies snapshot row i at steps[i] into slots[i] in every layer; step -1 keeps the slot;
    the scratch grows on demand and costs steps x bytes_per_slot per sequence."""
    pool = StatePool(_shape(num_slots=4))
    pool.begin_snapshots(3, 4)
    assert pool.snapshot_conv.shape == (2, 3, 4, 3, 24) and pool.snapshot_recurrent.shape == (2, 3, 4, 2, 4, 4)
    pool.snapshot_conv.copy_(torch.randn(pool.snapshot_conv.shape))
    pool.snapshot_recurrent.copy_(torch.randn(pool.snapshot_recurrent.shape))
    before = pool.read_slot(0)
    pool.commit_snapshots([2, 0, 1], [3, -1, 0])
    assert torch.equal(pool.conv[:, 2], pool.snapshot_conv[:, 0, 3])
    assert torch.equal(pool.recurrent[:, 1], pool.snapshot_recurrent[:, 2, 0])
    assert torch.equal(pool.read_slot(0)[1], before[1]) and torch.equal(pool.read_slot(0)[0], before[0])
    assert pool.snapshot_bytes_per_seq(4) == 4 * pool.shape.bytes_per_slot
    pool.begin_snapshots(5, 2)
    assert pool.snapshot_conv.shape[1:3] == (5, 4)


def test_fixed_snapshot_scratch_is_allocated_once_and_never_grows():
    """A pool built with snapshot_rows x snapshot_steps holds that scratch from the start, serves smaller verify
    steps from it, and refuses a larger one instead of allocating past the memory budget."""
    pool = StatePool(_shape(num_slots=4), snapshot_rows=3, snapshot_steps=4)
    conv, rec = pool.snapshot_conv, pool.snapshot_recurrent
    assert conv.shape == (2, 3, 4, 3, 24) and rec.shape == (2, 3, 4, 2, 4, 4)
    pool.begin_snapshots(2, 3)
    assert pool.snapshot_conv is conv and pool.snapshot_recurrent is rec
    with pytest.raises(RuntimeError, match="exceeds the state pool's snapshot scratch"):
        pool.begin_snapshots(4, 2)
    with pytest.raises(RuntimeError, match="exceeds"):
        pool.begin_snapshots(1, 5)
    with pytest.raises(ValueError, match="snapshot_rows"):
        StatePool(_shape(), snapshot_rows=2, snapshot_steps=0)
    with pytest.raises(ValueError, match="steps"):
        pool.commit_snapshots([0], [0, 1])
