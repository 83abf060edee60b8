"""LeaseTable: pages reserved for a request until its decode claims them, or until the deadline frees them."""
from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtransfer.errors import LeaseExpired, UnknownTransfer


@dataclass(frozen=True)
class Lease:
    lease_id: str
    request_id: str
    page_ids: tuple[int, ...]
    deadline_unix_ms: int
    state_slot: int | None = None  # models with linear attention: the state slot reserved with the pages
    # The decode worker's prefix-cache hit: page_ids[:cached_pages] are cached pages the lease holds a reference
    # on (prefill does not write them); checkpoint: the pinned KDA state checkpoint slot at the end of
    # page_ids[:checkpoint_pages] (None: none). Given back with the pages, exactly once (decode_worker/leases.py).
    cached_pages: int = 0
    checkpoint: int | None = None
    checkpoint_pages: int = 0

    @property
    def written_page_ids(self) -> tuple[int, ...]:
        """The pages prefill writes: those after the cached ones."""
        return self.page_ids[self.cached_pages:]


def cached_extents(lease: Lease, page_size: int) -> dict[str, int]:
    """A Destination's cached_tokens / checkpoint_tokens for a lease (token counts of its hit)."""
    return {"cached_tokens": lease.cached_pages * page_size,
            "checkpoint_tokens": lease.checkpoint_pages * page_size if lease.checkpoint is not None else 0}


class LeaseTable:
    """Thread-safe. The decode worker grants a lease per Reserve, claims it when Decode arrives, and calls
    expire() periodically to free the pages of leases nobody claimed.

    grace_s: expire() frees a lease only grace_s after its deadline, so that a writer that checked the
    deadline just before it passed has finished its last write before the pages are reused.
    """

    def __init__(self, grace_s: float = 1.0, clock: Callable[[], float] = time.time) -> None:
        if grace_s < 0:
            raise ValueError("grace_s must be non-negative")
        self.grace_s = grace_s
        self._clock = clock
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}

    def _now_ms(self) -> int:
        return int(self._clock() * 1000)

    def grant(self, request_id: str, page_ids: Sequence[int], ttl_s: float, state_slot: int | None = None,
              cached_pages: int = 0, checkpoint: int | None = None, checkpoint_pages: int = 0) -> Lease:
        if ttl_s <= 0:
            raise ValueError("ttl_s must be positive")
        if not 0 <= checkpoint_pages <= cached_pages < len(page_ids):
            raise ValueError(f"a lease of {len(page_ids)} pages cannot hold {cached_pages} cached pages "
                             f"({checkpoint_pages} checkpointed): at least one page is written")
        lease = Lease(secrets.token_hex(16), request_id, tuple(page_ids), self._now_ms() + int(ttl_s * 1000),
                      state_slot, cached_pages, checkpoint, checkpoint_pages)
        with self._lock:
            self._leases[lease.lease_id] = lease
        return lease

    def claim(self, lease_id: str) -> Lease:
        """Removes and returns the lease: its pages now belong to the running request.

        Raises UnknownTransfer (never granted, already claimed, released or expired) or LeaseExpired
        (deadline passed; the lease is dropped and its pages are the caller's to free).
        """
        with self._lock:
            lease = self._leases.pop(lease_id, None)
        if lease is None:
            raise UnknownTransfer(f"lease {lease_id} is unknown, already claimed or expired")
        if self._now_ms() >= lease.deadline_unix_ms:
            raise LeaseExpired(f"lease {lease_id} of request {lease.request_id} expired")
        return lease

    def release(self, lease_id: str) -> Lease | None:
        """Drops an unclaimed lease (abort); returns it so its pages can be freed, or None."""
        with self._lock:
            return self._leases.pop(lease_id, None)

    def get(self, lease_id: str) -> Lease | None:
        with self._lock:
            return self._leases.get(lease_id)

    def expire(self) -> list[Lease]:
        """Removes and returns every lease whose deadline passed more than grace_s ago (their pages to free)."""
        cutoff = self._now_ms() - int(self.grace_s * 1000)
        with self._lock:
            expired = [lease for lease in self._leases.values() if lease.deadline_unix_ms <= cutoff]
            for lease in expired:
                del self._leases[lease.lease_id]
        return expired

    def __len__(self) -> int:
        with self._lock:
            return len(self._leases)
