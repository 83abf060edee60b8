"""Routing policies over worker load snapshots (pure: no I/O, testable with plain numbers).

prefill: the healthy worker with the fewest outstanding prompt tokens (tracked by the gateway:
         added when a Prefill is sent, removed when it returns).
decode:  the healthy worker with the most uncommitted pages, then the fewest running requests
         (last GetDecodeLoad, adjusted by the gateway's own reservations since)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gateway.transport_choice import Placement


@dataclass
class PrefillState:
    address: str
    healthy: bool = True
    outstanding_tokens: int = 0
    outstanding_requests: int = 0
    placement: Placement | None = None  # from its load answers (the transport choice)


@dataclass
class DecodeState:
    address: str
    healthy: bool = True
    free_pages: int = 0        # uncommitted pages (what Reserve admits against)
    total_pages: int = 0
    running: int = 0
    page_size: int = 16
    placement: Placement | None = None  # from its load answers (the transport choice)
    free_state_slots: int | None = None  # linear-attention state slots free (None: the model has none)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // max(1, self.page_size))


class RoundRobinTieBreak:
    """Rotates the starting index so equally loaded workers take turns."""

    def __init__(self) -> None:
        self._next = 0

    def order(self, count: int) -> list[int]:
        start = self._next % count if count else 0
        self._next += 1
        return [(start + offset) % count for offset in range(count)]


class PrefillRouter:
    def __init__(self) -> None:
        self._ties = RoundRobinTieBreak()

    def rank(self, workers: Sequence[PrefillState]) -> list[int]:
        """Indices of healthy workers, best first."""
        order = self._ties.order(len(workers))
        healthy = [i for i in order if workers[i].healthy]
        return sorted(healthy, key=lambda i: (workers[i].outstanding_tokens, workers[i].outstanding_requests))


class DecodeRouter:
    def __init__(self) -> None:
        self._ties = RoundRobinTieBreak()

    def rank(self, workers: Sequence[DecodeState], num_tokens: int = 0) -> list[int]:
        """Indices of healthy workers, best first; workers that cannot hold num_tokens go last
        (their Reserve is still tried: the snapshot may be stale)."""
        order = self._ties.order(len(workers))
        healthy = [i for i in order if workers[i].healthy]

        def key(i: int) -> tuple[bool, int, int]:
            worker = workers[i]
            return (worker.free_pages < worker.pages_for(num_tokens), -worker.free_pages, worker.running)

        return sorted(healthy, key=key)
