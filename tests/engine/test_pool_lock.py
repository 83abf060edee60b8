"""Pages and state slots reserved from another thread (issue 18: a decode worker's Reserve runs on its event
loop, not between engine steps): the allocator and the state pool stay exact under concurrent use, and the
scheduler makes every free-count decision and allocation while holding the pool lock."""
from __future__ import annotations

import random
import threading

import torch

from engine.cache.kv_cache import OutOfPages, PageAllocator, PageTable
from engine.sampling_params import SamplingParams
from engine.runtime.scheduler import Scheduler, SchedulerConfig
from engine.runtime.sequence import Sequence, SeqStatus
from engine.cache.state_pool import OutOfStateSlots, StatePool, StateShape

PAGE_SIZE = 4


class _CountingLock:
    """A reentrant lock that knows how deep the current holder is in it."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self.depth = 0

    def __enter__(self) -> "_CountingLock":
        self._lock.acquire()
        self.depth += 1
        return self

    def __exit__(self, *exc: object) -> None:
        self.depth -= 1
        self._lock.release()


class _WatchedAllocator(PageAllocator):
    """Records how deep the lock was held whenever the free count is read or pages change hands."""

    def __init__(self, num_pages: int, lock: _CountingLock) -> None:
        super().__init__(num_pages, lock=lock)  # type: ignore[arg-type]
        self.depths: list[int] = []

    @property
    def num_free(self) -> int:
        self.depths.append(self.lock.depth)
        return super().num_free

    def allocate(self, count: int) -> list[int]:
        self.depths.append(self.lock.depth)
        return super().allocate(count)


def _sequence(allocator: PageAllocator, request_id: str, prompt_len: int, order: int) -> Sequence:
    return Sequence(request_id=request_id, prompt_len=prompt_len, token_ids=list(range(prompt_len)),
                    params=SamplingParams(max_new_tokens=8), page_table=PageTable(allocator, PAGE_SIZE),
                    arrival_order=order)


def test_the_scheduler_decides_and_allocates_under_the_pool_lock():
    """Every read of the free page count and every allocation the scheduler makes, in a prefill step and in a
    decode step that grows a running sequence, happens inside the scheduler's own hold of the pool lock."""
    lock = _CountingLock()
    allocator = _WatchedAllocator(16, lock)
    scheduler = Scheduler(SchedulerConfig(max_running=4, max_batched_tokens=64), allocator)
    running = _sequence(allocator, "running", 8, 0)
    running.page_table.ensure(8)
    running.num_cached, running.status = 8, SeqStatus.RUNNING
    running.token_ids.append(1)
    scheduler.running.append(running)
    scheduler.add(_sequence(allocator, "waiting", 10, 1))
    allocator.depths.clear()
    prefill = scheduler.schedule()
    assert [chunk.seq.request_id for chunk in prefill.prefill] == ["waiting"]
    scheduler.promote(prefill.prefill[0].seq)
    decode = scheduler.schedule()
    assert {seq.request_id for seq in decode.decode} == {"running", "waiting"}
    assert allocator.depths and min(allocator.depths) >= 1, allocator.depths
    assert lock.depth == 0


def test_concurrent_allocate_and_free_never_hand_a_page_out_twice():
    """Four threads allocating and freeing at random: no page is ever held by two owners at once, and in the
    end every page is free with no reference left."""
    allocator = PageAllocator(64)
    owners: dict[int, int] = {}
    owners_lock = threading.Lock()
    errors: list[str] = []

    def churn(worker: int) -> None:
        rng = random.Random(worker)
        held: list[int] = []
        for _ in range(2000):
            if held and rng.random() < 0.5:
                page = held.pop(rng.randrange(len(held)))
                with owners_lock:
                    del owners[page]
                allocator.free([page])
                continue
            try:
                pages = allocator.allocate(rng.randint(1, 3))
            except OutOfPages:
                continue
            with owners_lock:
                for page in pages:
                    if page in owners:
                        errors.append(f"page {page} given to {worker} while {owners[page]} holds it")
                    owners[page] = worker
            held += pages
        for page in held:
            with owners_lock:
                del owners[page]
            allocator.free([page])

    threads = [threading.Thread(target=churn, args=(worker,)) for worker in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not any(thread.is_alive() for thread in threads)
    assert errors == []
    assert allocator.num_free == 64 and all(allocator.refcount(page) == 0 for page in range(64))


def test_concurrent_state_slot_alloc_and_free_stay_exact():
    """Two threads taking and giving back state slots: a slot is never handed out twice, and all return."""
    shape = StateShape(num_kda_layers=1, num_slots=4, conv_width=2, conv_channels=6, num_heads=1, head_k_dim=2,
                       head_v_dim=2, conv_dtype=torch.float32, ssm_dtype=torch.float32)
    pool = StatePool(shape)
    taken: set[int] = set()
    taken_lock = threading.Lock()
    errors: list[str] = []

    def churn() -> None:
        for _ in range(1000):
            try:
                slot = pool.alloc()
            except OutOfStateSlots:
                continue
            with taken_lock:
                if slot in taken:
                    errors.append(f"slot {slot} handed out twice")
                taken.add(slot)
            with taken_lock:
                taken.discard(slot)
            pool.free(slot)

    threads = [threading.Thread(target=churn) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not any(thread.is_alive() for thread in threads)
    assert errors == [] and pool.num_free == 4
