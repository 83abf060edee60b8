"""Prefix cache bookkeeping without a model: the real Scheduler, PageAllocator, StatePool, PrefixCache and
PrefixReuse driven by a stand-in engine loop (forwards only advance num_cached).

Invariants: after any mix of shared-prefix requests, aborts, preemptions and evictions, the cache's own
bookkeeping holds at every step (PrefixCache.check_consistency), and once every request is gone every page is
free or cached with reference count 0, every state slot is free and no checkpoint is pinned."""
from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from engine.cache.kv_cache import PageAllocator, PageTable
from engine.cache.prefix_cache import PrefixCache
from engine.cache.prefix_reuse import PrefixReuse
from engine.sampling_params import SamplingParams
from engine.runtime.scheduler import Scheduler, SchedulerConfig
from engine.runtime.sequence import Sequence, SeqStatus
from engine.cache.state_pool import StatePool, StateShape
from engine.runtime.step_plan import CheckpointStatePlan

PAGE = 4


class MiniEngine:
    """The engine's control flow around the cache, with forwards replaced by num_cached bookkeeping."""

    def __init__(self, num_pages: int, kda: bool, max_batched: int, num_checkpoints: int = 3) -> None:
        self.state_pool = None
        if kda:
            shape = StateShape(num_kda_layers=1, num_slots=3, conv_width=2, conv_channels=3, num_heads=1,
                               head_k_dim=1, head_v_dim=1)
            self.state_pool = StatePool(shape)
        self.allocator = PageAllocator(num_pages, lock=self.state_pool.lock if kda else None)
        self.cache = PrefixCache(self.allocator, PAGE, "test", num_checkpoints, needs_checkpoints=kda,
                                 checkpoint_interval=2 * PAGE)
        self.plans: list[CheckpointStatePlan] = []
        self.reuse = PrefixReuse(self.cache, self.plans.append, PAGE, kda)
        self.scheduler = Scheduler(SchedulerConfig(max_running=3, max_batched_tokens=max_batched), self.allocator,
                                   self.state_pool, self.cache)
        self.seqs: dict[str, Sequence] = {}
        self.order = 0
        self.generated: dict[str, int] = {}  # finished request -> tokens it generated (-1: aborted, cannot fit)

    def add(self, rid: str, prompt: list[int], max_new: int) -> None:
        seq = Sequence(rid, len(prompt), list(prompt), SamplingParams(max_new_tokens=max_new, temperature=0.0),
                       PageTable(self.allocator, PAGE), arrival_order=self.order)
        self.order += 1
        self.seqs[rid] = seq
        self.scheduler.add(seq)

    def finish(self, seq: Sequence) -> None:
        self.scheduler.remove(seq)
        seq.status = SeqStatus.FINISHED
        self.reuse.before_release(seq)
        self.scheduler.drop_cache(seq)
        del self.seqs[seq.request_id]
        self.generated.setdefault(seq.request_id, seq.num_generated)

    def abort(self, rid: str) -> None:
        if rid in self.seqs:
            self.finish(self.seqs[rid])

    def step(self) -> None:
        step = self.scheduler.schedule()
        if step.is_empty and step.preempted:
            step = self.scheduler.schedule()
        if step.prefill:
            seqs = [chunk.seq for chunk in step.prefill]
            self.reuse.restore(seqs)
            for chunk in step.prefill:
                assert chunk.num_tokens > 0 and chunk.seq.num_cached % PAGE == 0 or chunk.seq.num_cached
                chunk.seq.num_cached += chunk.num_tokens
            self.reuse.after_prefill(seqs)
            for seq in seqs:
                if seq.remaining_prefill == 0:
                    self.scheduler.promote(seq)
                    self._append(seq)
        elif step.decode:
            starts = [seq.num_cached for seq in step.decode]
            for seq in step.decode:
                seq.num_cached += 1
                self._append(seq)
            self.reuse.after_decode([(s, row, start) for row, (s, start) in enumerate(zip(step.decode, starts))
                                     if s.status == SeqStatus.RUNNING], snapshot=False)
        elif self.scheduler.waiting and not self.scheduler.running:
            self.generated[self.scheduler.waiting[0].request_id] = -1
            self.finish(self.scheduler.waiting[0])  # cannot fit: the engine aborts it
        self.cache.check_consistency()

    def _append(self, seq: Sequence) -> None:
        seq.token_ids.append(7 + seq.num_generated % 3)
        if seq.num_generated >= seq.params.max_new_tokens:
            self.finish(seq)

    def assert_idle(self) -> None:
        """Every page free or cached with refcount 0, every state slot free, no checkpoint pinned."""
        assert all(self.allocator.refcount(p) == 0 for p in range(self.allocator.num_pages))
        assert self.allocator.num_free == self.allocator.num_pages
        stats = self.cache.snapshot()
        assert stats.evictable_pages == stats.cached_pages
        assert self.allocator.num_uncached_free + stats.cached_pages == self.allocator.num_pages
        if self.state_pool is not None:
            assert self.state_pool.num_free == self.state_pool.num_slots
            assert not self.cache.checkpoints._pins
        self.cache.check_consistency()


ops = st.lists(st.tuples(st.sampled_from(["add", "add", "step", "step", "step", "abort"]),
                         st.integers(0, 3), st.integers(1, 30), st.integers(1, 6)), min_size=5, max_size=60)


@pytest.mark.parametrize("kda", [False, True])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(script=ops, num_pages=st.integers(12, 40), max_batched=st.integers(3, 24), seed=st.integers(0, 1000))
def test_refcounts_after_random_shared_prefix_traffic(kda, script, num_pages, max_batched, seed):
    """Random shared-prefix requests (4 prefixes, random cut points and suffixes), aborts, preemptions (a small
    pool) and evictions keep every reference count right; draining leaves nothing held."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(2, 50) for _ in range(30)] for _ in range(4)]
    engine = MiniEngine(num_pages, kda, max_batched)
    for index, (op, which, cut, extra) in enumerate(script):
        if op == "add":
            prompt = prefixes[which][:cut] + [rng.randrange(2, 50) for _ in range(extra)]
            if -(-(len(prompt) + extra) // PAGE) + 1 <= num_pages:
                engine.add(f"r{index}", prompt, extra)
        elif op == "abort" and engine.seqs:
            engine.abort(rng.choice(sorted(engine.seqs)))
        else:
            engine.step()
    for _ in range(2000):
        if not engine.scheduler.has_work():
            break
        engine.step()
    assert not engine.scheduler.has_work()
    engine.assert_idle()


def test_shared_prefix_maps_cached_pages_and_negative_control():
    """A second request sharing 3 full pages maps them (one reference each while it runs); a one-token change in
    page 1 maps page 0 only; at least one token is always computed."""
    engine = MiniEngine(32, kda=False, max_batched=64)
    base = list(range(10, 24))  # 14 tokens: 3 full pages + 2
    engine.add("a", base, 1)
    engine.step()  # prefill a (finishes after its first token)
    assert not engine.seqs and engine.cache.snapshot().cached_pages == 3
    engine.add("b", base[:12] + [99], 2)
    engine.scheduler.schedule()
    seq = engine.seqs["b"]
    assert seq.num_cached_tokens == 12 and [engine.allocator.refcount(p) for p in seq.page_table.pages[:3]] == [1] * 3
    engine.abort("b")
    changed = list(base)
    changed[5] = 98
    engine.add("c", changed, 1)
    engine.scheduler.schedule()
    assert engine.seqs["c"].num_cached_tokens == PAGE
    engine.abort("c")
    engine.add("d", base[:12], 1)  # exactly 3 pages: the last one is computed, so 2 pages are mapped
    engine.scheduler.schedule()
    assert engine.seqs["d"].num_cached_tokens == 8
    engine.abort("d")
    engine.assert_idle()


def test_eviction_is_lru_leaves_first_and_cache_counts_as_free():
    """Unreferenced cached pages count as free; an allocation that needs them evicts the least recently used leaf
    first (so a chain is eaten from its end, keeping its shared start longest)."""
    engine = MiniEngine(6, kda=False, max_batched=64)
    engine.add("a", list(range(10, 23)), 1)  # 13 tokens: 3 full pages published
    engine.step()
    assert engine.allocator.num_free == 6 and engine.cache.snapshot().cached_pages == 3
    pages = engine.allocator.allocate(4)  # 3 truly free + 1 evicted: the chain's last page
    stats = engine.cache.snapshot()
    assert stats.evicted_pages == 1 and stats.cached_pages == 2
    engine.allocator.free(pages)
    engine.add("b", list(range(10, 23)), 1)
    engine.scheduler.schedule()
    assert engine.seqs["b"].num_cached_tokens == 2 * PAGE  # the first two pages survived
    engine.abort("b")
    engine.assert_idle()


def test_kda_hit_stops_at_last_checkpoint_and_pins_it():
    """KDA: checkpoints at every 2 pages and the prompt's last page boundary; a hit ends on the last matched page
    that has one, restores it into the slot (a plan), and the checkpoint stays pinned until restored."""
    engine = MiniEngine(32, kda=True, max_batched=64)
    engine.add("a", list(range(10, 33)), 1)  # 23 tokens: chunks end at 8, 16, 20; checkpoints there
    while engine.seqs:
        engine.step()
    saved = [pair for plan in engine.plans if plan.save for pair in plan.pairs]
    assert len(saved) == 3 and engine.cache.snapshot().checkpoints == 3
    engine.add("b", list(range(10, 28)) + [99], 1)  # shares 18 tokens: 4 full pages match, checkpoint at 16
    engine.scheduler.schedule()
    seq = engine.seqs["b"]
    assert seq.num_cached_tokens == 16 and seq.restore_checkpoint is not None
    assert engine.cache.checkpoints.pinned(seq.restore_checkpoint)
    engine.step()
    assert any(not plan.save for plan in engine.plans) and not engine.cache.checkpoints._pins
    while engine.seqs:
        engine.step()
    engine.assert_idle()


def test_a_request_needing_the_whole_pool_runs_by_evicting_the_cache():
    """The cache never holds pages a request needs: with every page cached, a request that needs the whole pool
    still runs to its end (evicting), and the checkpoint pool never grows past its slots."""
    engine = MiniEngine(12, kda=True, max_batched=64)
    for index in range(4):
        engine.add(f"fill{index}", [40 + index] * 11, 1)
        while engine.seqs:
            engine.step()
    stats = engine.cache.snapshot()
    assert stats.cached_pages == 8 and stats.checkpoints <= stats.checkpoint_slots == 3
    engine.add("big", list(range(2, 46)), 3)  # 44 + 3 tokens: all 12 pages
    while engine.seqs:
        engine.step()
    assert engine.generated["big"] == 3 and engine.cache.snapshot().evicted_pages >= 8
    engine.assert_idle()


def test_kda_branch_point_recomputes_once_and_checkpoints_the_matched_end():
    """KDA: a hit whose matched pages go past its last checkpoint (a branch) restores the checkpoint, ends its
    first chunk exactly at the matched run's end, swaps its recomputed duplicate pages there for the cached ones
    (freed; the table holds the cached pages) and saves a checkpoint there, so the next request sharing the
    prefix hits all of it; a changed token inside the branch's page gets only the pages before it."""
    engine = MiniEngine(40, kda=True, max_batched=64, num_checkpoints=8)
    engine.add("a", list(range(10, 41)), 1)  # 31 tokens: chunks end at 8, 16, 24, 28; checkpoints there
    while engine.seqs:
        engine.step()
    cache = engine.cache
    assert cache.snapshot().checkpoints == 4
    shared = list(range(10, 32))  # 22 tokens: 5 full pages match, the last checkpoint at 16 -> branch page 16..20
    engine.add("b", shared + [99, 98, 97, 96, 95, 94], 1)  # 28 tokens: without the branch the chunk would end at 24
    step = engine.scheduler.schedule()
    seq = engine.seqs["b"]
    assert seq.num_cached_tokens == 16 and len(seq.branch_pages) == 1 and seq.branch_end == 20
    branch_page = seq.branch_pages[0]
    assert engine.allocator.refcount(branch_page) == 1  # referenced by the lookup, not yet in the table
    assert [chunk.num_tokens for chunk in step.prefill] == [4]  # the chunk ends at the branch's end
    duplicate = seq.page_table.pages[4]
    engine.reuse.restore([seq])
    seq.num_cached += 4
    saves_before = sum(len(plan.pairs) for plan in engine.plans if plan.save)
    engine.reuse.after_prefill([seq])
    assert seq.page_table.pages[4] == branch_page and not seq.branch_pages
    assert len(seq.page_table.cache_keys) == 5 and engine.allocator.refcount(duplicate) == 0
    assert sum(len(plan.pairs) for plan in engine.plans if plan.save) == saves_before + 1
    assert cache.snapshot().checkpoints == 5
    cache.check_consistency()
    while engine.seqs:
        engine.step()
    engine.add("c", shared + [98, 97], 1)
    engine.scheduler.schedule()
    assert engine.seqs["c"].num_cached_tokens == 20 and not engine.seqs["c"].branch_pages
    engine.abort("c")
    changed = list(shared)
    changed[18] = 3  # inside page 4 (16..20): only the first 4 pages are usable, no branch
    engine.add("d", changed + [98], 1)
    engine.scheduler.schedule()
    assert engine.seqs["d"].num_cached_tokens == 16 and not engine.seqs["d"].branch_pages
    engine.abort("d")
    engine.assert_idle()


def test_an_aborted_branch_gives_its_pages_back():
    """A sequence aborted (or preempted) before its prefill reaches the branch's end drops the branch's
    references: nothing stays referenced after it goes."""
    engine = MiniEngine(40, kda=True, max_batched=2, num_checkpoints=8)  # 2-token chunks: the branch is still pending after one step
    engine.add("a", list(range(10, 41)), 1)
    while engine.seqs:
        engine.step()
    engine.add("b", list(range(10, 32)) + [99], 1)
    engine.step()
    seq = engine.seqs["b"]
    assert seq.branch_pages and seq.num_cached < seq.branch_end
    engine.abort("b")
    engine.assert_idle()


def test_a_branch_from_the_start_is_looked_up_once():
    """A hit whose matched pages have no checkpoint at all maps no page (the whole run is its branch); when no
    page is free for its first chunk it waits, and the next schedule keeps that branch instead of looking up
    (and referencing) it again: after it runs and finishes, nothing stays referenced."""
    engine = MiniEngine(40, kda=True, max_batched=64, num_checkpoints=8)
    engine.add("a", list(range(10, 32)), 1)  # 22 tokens: 5 full pages cached
    while engine.seqs:
        engine.step()
    assert engine.cache.snapshot().cached_pages == 5
    for slot_node in list(engine.cache.checkpoints._lru.values()):
        engine.cache.drop_checkpoint(slot_node.key)
    assert engine.cache.snapshot().checkpoints == 0
    held = engine.allocator.allocate(engine.allocator.num_uncached_free)  # only the cached pages stay free
    engine.add("b", list(range(10, 32)) + [99, 98, 97, 96, 95, 94], 1)
    engine.scheduler.schedule()
    seq = engine.seqs["b"]
    assert seq.num_cached == 0 and len(seq.branch_pages) == 5 and not seq.page_table.pages
    branch = seq.branch_pages
    engine.scheduler.schedule()  # still no free page for its chunk: it waits, keeping its branch
    assert seq.branch_pages == branch and all(engine.allocator.refcount(page) == 1 for page in branch)
    engine.allocator.free(held)
    while engine.seqs:
        engine.step()
    engine.assert_idle()
