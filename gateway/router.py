"""Routing policies over worker load snapshots (pure: no I/O, testable with plain numbers).

prefill: the healthy worker with the fewest outstanding prompt tokens (tracked by the gateway:
         PrefillLoad.claim while a prefill is out).
decode:  the healthy worker with the most uncommitted pages, then the fewest running requests
         (last GetDecodeLoad, adjusted by the gateway's own reservations since: DecodeLoad's methods).
Cache-aware (a weight w > 0 and each worker's uncached prompt tokens, from the KV index: gateway/kv_index.py), the
lowest cost wins (docs/services.md):
  prefill cost = w * uncached_tokens / page_size + outstanding_tokens / page_size
  decode cost  = w * uncached_pages + load_pages    (load_pages = total_pages - free_pages - spares' pages)
and a decode worker that cannot hold the prompt, or uses more than max_load of its pages, ranks after the others
(by load only): a conversation stays where its history is unless that worker is overloaded. w = 0: load only (the
orders above).
The load dataclasses are the one owner of the gateway's load accounting."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from gateway.transport_choice import Placement


@dataclass
class PrefillLoad:
    """A prefill worker's load as the gateway counts it: the prompts it sent there and has no answer for yet.
    The one place these counts change: claim() when a prefill is sent, release() when it is answered."""

    address: str
    healthy: bool = True
    outstanding_tokens: int = 0
    outstanding_requests: int = 0
    placement: Placement | None = None  # from its load answers (the transport choice)

    @contextlib.contextmanager
    def claim(self, num_tokens: int) -> Iterator[None]:
        """Counts a prefill of num_tokens prompt tokens against the worker while the block runs."""
        self.outstanding_tokens += num_tokens
        self.outstanding_requests += 1
        try:
            yield
        finally:
            self.outstanding_tokens -= num_tokens
            self.outstanding_requests -= 1


@dataclass
class DecodeLoad:
    """A decode worker's load: its last GetDecodeLoad answer, adjusted by what the gateway reserved there since.
    The one place these figures change (polls, Reserve claims and their outcome, standing leases)."""

    address: str
    healthy: bool = True
    free_pages: int = 0        # uncommitted pages (what Reserve admits against)
    total_pages: int = 0
    running: int = 0
    page_size: int = 16
    placement: Placement | None = None  # from its load answers (the transport choice)
    free_state_slots: int | None = None  # linear-attention state slots free (None: the model has none)
    standing_pages: int = 0  # of the pages not free, those gateways' spares hold (standing leases; any request's)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // max(1, self.page_size))

    def polled(self, free_pages: int, total_pages: int, running: int, page_size: int,
               free_state_slots: int | None, placement: Placement, standing_pages: int = 0) -> None:
        """A load answer: its figures replace the estimates."""
        self.free_pages, self.total_pages, self.running = max(0, free_pages), total_pages, running
        self.page_size, self.free_state_slots, self.placement = page_size or 16, free_state_slots, placement
        self.standing_pages = standing_pages

    @property
    def load_pages(self) -> int:
        """Pages held by requests (running or reserved): the pool less its free pages and the spares' pages."""
        return self.total_pages - self.free_pages - self.standing_pages

    def claim(self, num_tokens: int) -> int:
        """A Reserve for num_tokens is sent: counted now, not when its answer comes back, so the requests of a
        burst routed meanwhile see it instead of all ranking the same snapshot first. Returns the pages
        claimed (for unclaim / granted)."""
        pages = self.pages_for(num_tokens)
        self.free_pages -= pages
        self.running += 1
        return pages

    def unclaim(self, pages: int) -> None:
        """The Reserve that claimed `pages` did not succeed."""
        self.free_pages += pages
        self.running = max(0, self.running - 1)

    def granted(self, claimed: int, pages: int) -> None:
        """The Reserve that claimed `claimed` pages got `pages`: the estimate becomes the real count."""
        self.free_pages += claimed - pages

    def full(self) -> None:
        """The worker refused a Reserve for room: no free pages until the next poll says otherwise."""
        self.free_pages = 0

    def spare_granted(self, pages: int) -> None:
        """A standing lease of `pages` (and a state slot, for linear attention) was granted there."""
        self.free_pages = max(0, self.free_pages - pages)
        self.standing_pages += pages  # (a spare is not load: load_pages stays)
        if self.free_state_slots is not None:  # until the next poll says otherwise
            self.free_state_slots = max(0, self.free_state_slots - 1)

    def spare_taken(self) -> None:
        """A request took that worker's standing lease: it runs there."""
        self.running += 1


class RoundRobinTieBreak:
    """Rotates the starting index so equally loaded workers take turns."""

    def __init__(self) -> None:
        self._next = 0

    def order(self, count: int) -> list[int]:
        start = self._next % count if count else 0
        self._next += 1
        return [(start + offset) % count for offset in range(count)]


@dataclass(frozen=True)
class CacheWeights:
    """weight: the cost of one uncached page against one page of load (0: route by load only); max_load: the
    fraction of its pages a decode worker may use before its cache stops counting (it then ranks after the others)."""

    weight: float = 0.0
    max_load: float = 0.9

    def __post_init__(self) -> None:
        if self.weight < 0:
            raise ValueError(f"the cache routing weight must be non-negative, got {self.weight}")
        if not 0 < self.max_load <= 1:
            raise ValueError(f"the cache routing max load must be in (0, 1], got {self.max_load}")


class PrefillRouter:
    def __init__(self) -> None:
        self._ties = RoundRobinTieBreak()

    def rank(self, workers: Sequence[PrefillLoad], uncached: Sequence[int] | None = None,
             weights: CacheWeights = CacheWeights(), page_size: int = 16) -> list[int]:
        """Indices of healthy workers, best first. uncached: each worker's prompt tokens its cache lacks (None:
        load only)."""
        order = self._ties.order(len(workers))
        healthy = [i for i in order if workers[i].healthy]
        size = max(1, page_size)

        def key(i: int) -> tuple[float, int]:
            worker = workers[i]
            cache = weights.weight * uncached[i] / size if uncached is not None and weights.weight else 0.0
            return (cache + worker.outstanding_tokens / size, worker.outstanding_requests)

        return sorted(healthy, key=key)


class DecodeRouter:
    def __init__(self) -> None:
        self._ties = RoundRobinTieBreak()

    def rank(self, workers: Sequence[DecodeLoad], num_tokens: int = 0, uncached: Sequence[int] | None = None,
             weights: CacheWeights = CacheWeights()) -> list[int]:
        """Indices of healthy workers, best first; workers that cannot hold num_tokens go last
        (their Reserve is still tried: the snapshot may be stale). uncached: each worker's prompt tokens its
        cache lacks (None, or weight 0: load only)."""
        order = self._ties.order(len(workers))
        healthy = [i for i in order if workers[i].healthy]
        cache_aware = uncached is not None and weights.weight > 0

        def key(i: int) -> tuple[bool, float, int]:
            worker = workers[i]
            last = worker.free_pages < worker.pages_for(num_tokens)
            if not cache_aware:
                return (last, -worker.free_pages, worker.running)
            used = worker.load_pages
            if not last and worker.total_pages and used > weights.max_load * worker.total_pages:
                last = True  # overloaded: its cache does not count
            cache = weights.weight * worker.pages_for(uncached[i]) if not last else 0.0
            return (last, cache + used, worker.running)

        return sorted(healthy, key=key)
