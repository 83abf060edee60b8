"""The Scheduler's policy on its own (engine/runtime/scheduler.py; no model): prefill first within the token budget;
when a decode step runs out of pages, the newest partly prefilled waiting sequence gives its pages back first,
then the most recently arrived running sequence is preempted (back to the front of the waiting queue, its
cache dropped, its tokens kept); the oldest running sequence always keeps running."""
from __future__ import annotations

from engine.cache.kv_cache import PageAllocator, PageTable
from engine.sampling_params import SamplingParams
from engine.runtime.scheduler import Scheduler, SchedulerConfig
from engine.runtime.sequence import Sequence, SeqStatus

PAGE_SIZE = 4


def _sequence(allocator: PageAllocator, request_id: str, prompt_len: int, order: int) -> Sequence:
    return Sequence(request_id=request_id, prompt_len=prompt_len, token_ids=list(range(prompt_len)),
                    params=SamplingParams(max_new_tokens=64), page_table=PageTable(allocator, PAGE_SIZE),
                    arrival_order=order)


def _running(scheduler: Scheduler, allocator: PageAllocator, request_id: str, cached: int, order: int) -> Sequence:
    """A running sequence whose cache holds `cached` tokens, its next token appended (cache = all but the last)."""
    seq = _sequence(allocator, request_id, cached, order)
    seq.page_table.ensure(cached)
    seq.num_cached, seq.status = cached, SeqStatus.RUNNING
    seq.token_ids.append(1)
    scheduler.running.append(seq)
    return seq


def test_prefill_runs_first_in_arrival_order_within_the_token_budget():
    """Waiting sequences are chunked in arrival order up to max_batched_tokens (the last one cut short), ahead of
    the running ones' decode."""
    allocator = PageAllocator(64)
    scheduler = Scheduler(SchedulerConfig(max_running=8, max_batched_tokens=10), allocator)
    _running(scheduler, allocator, "running", 4, 0)
    for order, (name, length) in enumerate((("a", 6), ("b", 8)), start=1):
        scheduler.add(_sequence(allocator, name, length, order))
    step = scheduler.schedule()
    assert [(chunk.seq.request_id, chunk.num_tokens) for chunk in step.prefill] == [("a", 6), ("b", 4)]
    assert step.decode == () and step.preempted == ()


def test_out_of_pages_the_newest_waiting_sequence_gives_its_pages_back_first():
    """A decode step that needs a page while none is free takes the pages of the newest partly prefilled waiting
    sequence (its cache dropped, recomputed later) before it preempts anyone; the older waiting one keeps its
    pages."""
    allocator = PageAllocator(4)
    scheduler = Scheduler(SchedulerConfig(max_running=1, max_batched_tokens=64), allocator)
    running = _running(scheduler, allocator, "running", 4, 0)  # 1 page, full: its next token needs a second
    older, newer = _sequence(allocator, "older", 8, 1), _sequence(allocator, "newer", 8, 2)
    for seq, pages in ((older, 2), (newer, 1)):  # partly prefilled, held back by max_running
        seq.page_table.ensure(pages * PAGE_SIZE)
        seq.num_cached = pages * PAGE_SIZE - 1
        scheduler.add(seq)
    assert allocator.num_free == 0
    step = scheduler.schedule()
    assert step.decode == (running,) and step.preempted == ()
    assert newer.page_table.pages == [] and newer.num_cached == 0 and list(scheduler.waiting) == [older, newer]
    assert len(older.page_table.pages) == 2 and older.num_cached == 7
    assert len(running.page_table.pages) == 2


def test_out_of_pages_the_most_recent_running_sequence_is_preempted():
    """With no waiting pages to reclaim, the most recently arrived running sequence is preempted: its pages freed,
    its cache dropped, its tokens kept, and it waits at the front of the queue; the older ones run."""
    allocator = PageAllocator(4)
    scheduler = Scheduler(SchedulerConfig(max_running=8, max_batched_tokens=64), allocator)
    first = _running(scheduler, allocator, "first", 4, 0)
    newest = _running(scheduler, allocator, "newest", 4, 2)
    middle = _running(scheduler, allocator, "middle", 4, 1)
    tokens = list(newest.token_ids)
    step = scheduler.schedule()  # each needs a second page, one is free: "middle" gets the newest one's
    assert step.preempted == (newest,)
    assert set(step.decode) == {first, middle}
    assert newest.status == SeqStatus.WAITING and newest.num_cached == 0 and newest.page_table.pages == []
    assert newest.token_ids == tokens and list(scheduler.waiting) == [newest] and newest not in scheduler.running
    assert allocator.num_free == 0 and len(first.page_table.pages) == len(middle.page_table.pages) == 2


def _advance(step, scheduler: Scheduler) -> None:
    """What the engine does with a step's plan, for the cache counts: chunks cached, decodes one token on."""
    for chunk in step.prefill:
        chunk.seq.num_cached += chunk.num_tokens
        if chunk.seq.remaining_prefill == 0:
            chunk.seq.token_ids.append(1)
            scheduler.promote(chunk.seq)
    for seq in step.decode:
        seq.num_cached += 1
        seq.token_ids.append(1)


def test_bounded_prefill_alternates_with_decode_steps():
    """prefill_tokens_while_decoding (decode workers' local prefills): while a sequence decodes, a waiting prompt is
    prefilled at most N tokens per step and every prefill step is followed by a decode step, so the running
    sequence waits at most one bounded step between two tokens; with nothing running the whole budget is used."""
    allocator = PageAllocator(256)
    scheduler = Scheduler(SchedulerConfig(max_running=8, max_batched_tokens=64, prefill_tokens_while_decoding=8),
                          allocator)
    running = _running(scheduler, allocator, "running", 4, 0)
    scheduler.add(_sequence(allocator, "long", 30, 1))
    kinds = []
    for _ in range(8):
        step = scheduler.schedule()
        kinds.append(("prefill", [chunk.num_tokens for chunk in step.prefill]) if step.prefill else
                     ("decode", [seq.request_id for seq in step.decode]))
        _advance(step, scheduler)
    assert kinds == [("prefill", [8]), ("decode", ["running"]), ("prefill", [8]), ("decode", ["running"]),
                     ("prefill", [7]), ("decode", ["running"]), ("prefill", [7]), ("decode", ["running", "long"])]
    idle = Scheduler(SchedulerConfig(max_running=8, max_batched_tokens=64, prefill_tokens_while_decoding=8),
                     PageAllocator(256))
    idle.add(_sequence(idle.allocator, "alone", 30, 0))
    assert [chunk.num_tokens for chunk in idle.schedule().prefill] == [30]
    assert running.num_cached == 8


def test_mixed_steps_put_the_bounded_chunk_into_every_decode_step():
    """mixed_steps: while a sequence decodes, each step carries both a bounded prefill chunk and the decode of every
    running sequence (one forward), so the running sequence gets a token every step; once the prompt is done it
    decodes in the same steps. A running sequence that may speculate brings back the alternation."""
    allocator = PageAllocator(256)
    config = SchedulerConfig(max_running=8, max_batched_tokens=64, prefill_tokens_while_decoding=8, mixed_steps=True)
    scheduler = Scheduler(config, allocator)
    running = _running(scheduler, allocator, "running", 4, 0)
    scheduler.add(_sequence(allocator, "long", 30, 1))
    steps = []
    for _ in range(5):
        step = scheduler.schedule()
        steps.append(([chunk.num_tokens for chunk in step.prefill], [seq.request_id for seq in step.decode]))
        _advance(step, scheduler)
    assert steps == [([8], ["running"]), ([8], ["running"]), ([7], ["running"]), ([7], ["running"]),
                     ([], ["running", "long"])]
    assert running.num_cached == 4 + 5  # a token in every one of the five steps
    speculating = Scheduler(config, PageAllocator(256))
    drafter = _running(speculating, speculating.allocator, "drafter", 4, 0)
    drafter.spec_block_size = 4
    speculating.add(_sequence(speculating.allocator, "waiting", 30, 1))
    first, second = speculating.schedule(), None
    _advance(first, speculating)
    second = speculating.schedule()
    assert ([c.num_tokens for c in first.prefill], first.decode) == ([8], ())
    assert (second.prefill, second.decode) == ((), (drafter,))


def test_bounded_prefill_spreads_the_waiting_tokens_evenly():
    """Under the bound the waiting tokens take as few steps as greedy chunking needs, evenly filled: a 20-token
    prompt under a bound of 16 goes as 10 + 10 (not 16 + 4), two prompts of 12 as 12 + 12 (24 tokens, 2 steps),
    so the longest step beside the decodes is as short as the step count allows."""
    for prompts, expected in (([20], [[10], [10]]), ([12, 12], [[12], [12]]), ([16], [[16]]), ([33], [[11]] * 3)):
        allocator = PageAllocator(256)
        config = SchedulerConfig(max_running=8, max_batched_tokens=64, prefill_tokens_while_decoding=16,
                                 mixed_steps=True)
        scheduler = Scheduler(config, allocator)
        _running(scheduler, allocator, "running", 4, 0)
        for index, length in enumerate(prompts):
            scheduler.add(_sequence(allocator, f"prompt{index}", length, index + 1))
        sizes = []
        for _ in range(len(expected)):
            step = scheduler.schedule()
            sizes.append([chunk.num_tokens for chunk in step.prefill])
            _advance(step, scheduler)
        assert sizes == expected, (prompts, sizes)


def test_without_the_bound_prefill_runs_first():
    """prefill_tokens_while_decoding 0 (the default): the waiting prompt takes consecutive max_batched_tokens steps."""
    allocator = PageAllocator(256)
    scheduler = Scheduler(SchedulerConfig(max_running=8, max_batched_tokens=10), allocator)
    _running(scheduler, allocator, "running", 4, 0)
    scheduler.add(_sequence(allocator, "long", 30, 1))
    sizes = []
    for _ in range(3):
        step = scheduler.schedule()
        sizes.append([chunk.num_tokens for chunk in step.prefill])
        _advance(step, scheduler)
    assert sizes == [[10], [10], [10]]
