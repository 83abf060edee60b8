"""LeaseTable: grant / claim / release / expire with a controllable clock; thread-safe under contention."""
from __future__ import annotations

import threading

import pytest

from kvtransfer.errors import LeaseExpired, UnknownTransfer
from kvtransfer.leases import LeaseTable


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_claim_before_deadline_removes_the_lease():
    """A claimed lease is gone: claiming twice is UnknownTransfer, and it never expires."""
    clock = Clock()
    table = LeaseTable(grace_s=0, clock=clock)
    lease = table.grant("r", [3, 4], ttl_s=5)
    assert lease.deadline_unix_ms == 1_005_000 and lease.page_ids == (3, 4)
    assert table.claim(lease.lease_id) == lease
    with pytest.raises(UnknownTransfer):
        table.claim(lease.lease_id)
    clock.now += 100
    assert table.expire() == [] and len(table) == 0


def test_expire_waits_for_the_grace_period_and_returns_the_pages():
    """Past the deadline a claim fails (LeaseExpired); expire() returns the lease only after the grace."""
    clock = Clock()
    table = LeaseTable(grace_s=2, clock=clock)
    late, early = table.grant("late", [1], ttl_s=10), table.grant("early", [2, 5], ttl_s=1)
    clock.now += 1.5
    assert table.expire() == []  # early's deadline passed 0.5 s ago, grace is 2 s
    clock.now += 2
    assert table.expire() == [early]
    with pytest.raises(UnknownTransfer):
        table.claim(early.lease_id)
    clock.now += 10
    with pytest.raises(LeaseExpired):
        table.claim(late.lease_id)
    assert len(table) == 0


def test_release_is_idempotent():
    """release() returns the lease once, then None."""
    table = LeaseTable()
    lease = table.grant("r", [0], ttl_s=1)
    assert table.release(lease.lease_id) == lease and table.release(lease.lease_id) is None


def test_invalid_arguments():
    with pytest.raises(ValueError):
        LeaseTable(grace_s=-1)
    with pytest.raises(ValueError):
        LeaseTable().grant("r", [0], ttl_s=0)


def test_concurrent_grants_and_claims_lose_nothing():
    """8 threads x 200 grant+claim pairs: every lease claimed exactly once, ids unique, table empty."""
    table = LeaseTable()
    claimed: list[str] = []
    lock = threading.Lock()

    def work(thread: int) -> None:
        for index in range(200):
            lease = table.grant(f"{thread}-{index}", [index], ttl_s=60)
            assert table.claim(lease.lease_id).request_id == f"{thread}-{index}"
            with lock:
                claimed.append(lease.lease_id)

    threads = [threading.Thread(target=work, args=(thread,)) for thread in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(claimed) == len(set(claimed)) == 1600 and len(table) == 0
