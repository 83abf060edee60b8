"""Routing policies: prefill by fewest outstanding prompt tokens, decode by most free pages then fewest running."""
from __future__ import annotations

from gateway.router import DecodeLoad, DecodeRouter, PrefillLoad, PrefillRouter


def test_prefill_picks_fewest_outstanding_tokens_and_skips_unhealthy():
    """The healthy worker with the least queued prompt work is first; an unhealthy one is never offered."""
    workers = [PrefillLoad("a", outstanding_tokens=500), PrefillLoad("b", outstanding_tokens=20),
               PrefillLoad("c", healthy=False), PrefillLoad("d", outstanding_tokens=100)]
    assert PrefillRouter().rank(workers) == [1, 3, 0]


def test_prefill_ties_rotate():
    """Equally loaded workers take turns being first."""
    router = PrefillRouter()
    workers = [PrefillLoad("a"), PrefillLoad("b"), PrefillLoad("c")]
    firsts = [router.rank(workers)[0] for _ in range(6)]
    assert sorted(set(firsts)) == [0, 1, 2]


def test_decode_prefers_free_pages_then_fewer_running():
    """Most free pages first; among equals, fewer running requests first."""
    workers = [DecodeLoad("a", free_pages=10, running=0), DecodeLoad("b", free_pages=50, running=9),
               DecodeLoad("c", free_pages=50, running=2), DecodeLoad("d", free_pages=99, healthy=False)]
    assert DecodeRouter().rank(workers) == [2, 1, 0]


def test_decode_worker_that_cannot_fit_goes_last():
    """A worker whose free pages cannot hold the request ranks after those that can."""
    workers = [DecodeLoad("a", free_pages=3, running=0, page_size=16), DecodeLoad("b", free_pages=2, running=5, page_size=4)]
    assert DecodeRouter().rank(workers, num_tokens=40) == [0, 1]
    assert DecodeRouter().rank(workers, num_tokens=60) == [0, 1]
    assert DecodeRouter().rank(workers, num_tokens=8) == [0, 1]
    workers[0].free_pages = 1
    assert DecodeRouter().rank(workers, num_tokens=8) == [1, 0]
