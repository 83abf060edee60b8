"""benchmarks/profile_first_token.py and first_token_ab.py: the per-piece measurement and its summary, and
(slow) every piece of the first-token harness running over the real handlers and services."""
from __future__ import annotations

import pytest

from benchmarks.first_token_ab import spread
from benchmarks.profile_first_token import measure


async def test_measure_gives_one_mean_per_round_for_each_piece_in_microseconds():
    """Each piece gets `rounds` values, each the mean of `reps` calls in us less the clock's cost (never
    negative); pieces take turns within a round (call order interleaves)."""
    order: list[str] = []

    def piece(name: str, ns: int):
        async def once() -> int:
            order.append(name)
            return ns
        return once

    results = await measure({"a": piece("a", 50_000), "b": piece("b", 0)}, reps=4, rounds=3)
    assert set(results) == {"a", "b"} and all(len(values) == 3 for values in results.values())
    assert all(40.0 <= value <= 50.0 for value in results["a"])  # 50 us less the clock pair's cost
    assert results["b"] == [0.0, 0.0, 0.0]
    assert order == (["a"] * 4 + ["b"] * 4) * 3


def test_spread_is_the_tenth_to_ninetieth_percentile():
    """p10..p90 of 1..10 is 2..9 (the lowest and highest tenth left out); one value is its own spread."""
    assert spread([float(v) for v in range(10, 0, -1)]) == "2.0..9.0"
    assert spread([3.0]) == "3.0..3.0"


@pytest.mark.slow
async def test_every_piece_of_the_harness_runs_over_the_real_services():
    """The harness's pieces (gateway and prefill handlers end to end without gRPC, the conversions, the
    interceptors) each run and report a CPU time; the prefill side leaves no job or reservation behind."""
    from benchmarks.common import DEFAULT_MODEL
    from benchmarks.first_token_fixtures import interceptor_pieces
    from benchmarks.first_token_gateway import GatewaySide
    from benchmarks.first_token_prefill import PrefillSide

    prefill = await PrefillSide.start(str(DEFAULT_MODEL))
    gateway = await GatewaySide.start(str(DEFAULT_MODEL), prefill.layout)
    try:
        prompt = list(range(10, 42))
        pieces = {**gateway.pieces(prompt), **prefill.pieces(prompt), **interceptor_pieces()}
        for name, piece in pieces.items():
            assert await piece() >= 0, name
        assert prefill.service._jobs == {} and gateway.service.num_running == 0
    finally:
        await gateway.close()
        await prefill.close()
