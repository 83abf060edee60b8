"""Routing policies: prefill by fewest outstanding prompt tokens, decode by most free pages then fewest running."""
from __future__ import annotations

from gateway.router import CacheWeights, DecodeLoad, DecodeRouter, PrefillLoad, PrefillRouter


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


def test_cache_weight_zero_is_load_only():
    """Weight 0: the uncached counts change nothing (the load order above); negative control: weight 1 puts the
    worker holding the prompt first."""
    decode = [DecodeLoad("a", free_pages=50, total_pages=100), DecodeLoad("b", free_pages=48, total_pages=100)]
    assert DecodeRouter().rank(decode, 64, [64, 0], CacheWeights(0.0)) == [0, 1]
    assert DecodeRouter().rank(decode, 64, [64, 0], CacheWeights(1.0)) == [1, 0]
    prefill = [PrefillLoad("a", outstanding_tokens=0), PrefillLoad("b", outstanding_tokens=32)]
    assert PrefillRouter().rank(prefill, [256, 0], CacheWeights(0.0)) == [0, 1]
    assert PrefillRouter().rank(prefill, [256, 0], CacheWeights(1.0)) == [1, 0]


def test_cache_cost_is_weighed_against_load():
    """cost = w * uncached pages + load pages: a hit of 4 pages does not beat 10 pages more load at w = 1, does at
    w = 3 (decode); prefill likewise with outstanding tokens in pages."""
    decode = [DecodeLoad("a", free_pages=90, total_pages=100, page_size=16),
              DecodeLoad("b", free_pages=80, total_pages=100, page_size=16)]
    uncached = [64, 0]  # b holds 4 pages of the prompt
    assert DecodeRouter().rank(decode, 64, uncached, CacheWeights(1.0)) == [0, 1]  # 4 + 10 < 0 + 20
    assert DecodeRouter().rank(decode, 64, uncached, CacheWeights(3.0)) == [1, 0]  # 12 + 10 > 0 + 20
    prefill = [PrefillLoad("a", outstanding_tokens=0), PrefillLoad("b", outstanding_tokens=160)]
    assert PrefillRouter().rank(prefill, uncached, CacheWeights(1.0), page_size=16) == [0, 1]  # 4 < 10
    assert PrefillRouter().rank(prefill, uncached, CacheWeights(3.0), page_size=16) == [1, 0]  # 12 > 10


def test_overloaded_worker_loses_its_cache_advantage():
    """A decode worker above max_load (or unable to fit the prompt) ranks after the others whatever it holds."""
    decode = [DecodeLoad("a", free_pages=50, total_pages=100), DecodeLoad("b", free_pages=5, total_pages=100)]
    assert DecodeRouter().rank(decode, 16, [16, 0], CacheWeights(100.0, max_load=0.9)) == [0, 1]
    assert DecodeRouter().rank(decode, 16, [16, 0], CacheWeights(100.0, max_load=1.0)) == [1, 0]  # not overloaded
    assert DecodeRouter().rank(decode, 200, [200, 0], CacheWeights(100.0, max_load=1.0)) == [0, 1]  # cannot fit


def test_cache_weights_refuse_bad_values():
    """A negative weight or a max load outside (0, 1] is refused by name."""
    import pytest

    with pytest.raises(ValueError, match="weight"):
        CacheWeights(-1.0)
    with pytest.raises(ValueError, match="max load"):
        CacheWeights(1.0, max_load=0.0)


def test_spares_are_not_load():
    """Pages a gateway's spare holds (standing leases) do not count as load in the cache-aware cost: a worker whose
    pages are all free but for a 64-page spare keeps its cache advantage (negative control: counted as load, the
    spare would outweigh the 4 uncached pages)."""
    holder = DecodeLoad("a", free_pages=36, total_pages=100, page_size=16, standing_pages=64)
    other = DecodeLoad("b", free_pages=100, total_pages=100, page_size=16)
    assert holder.load_pages == 0
    assert DecodeRouter().rank([holder, other], 64, [0, 64], CacheWeights(1.0)) == [0, 1]
    holder.standing_pages = 0
    assert DecodeRouter().rank([holder, other], 64, [0, 64], CacheWeights(1.0)) == [1, 0]
