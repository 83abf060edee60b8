"""Load generation: gamma/Poisson arrival statistics, send schedule, and the concurrency cap."""
from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace

import numpy as np
import pytest

from bench import load
from bench.load import LoadPlan, arrival_gaps, run_load, send_offsets
from bench.record import RequestRecord
from bench.workload import BenchRequest


@pytest.mark.parametrize("rate, burstiness", [(10.0, 1.0), (250.0, 0.25), (3.0, 4.0)])
def test_mean_gap_is_inverse_rate_and_cv_follows_burstiness(rate, burstiness):
    """Over many samples the mean gap is 1/rate and the coefficient of variation 1/sqrt(burstiness)."""
    gaps = arrival_gaps(200_000, rate, burstiness, np.random.default_rng(0))
    assert gaps.mean() == pytest.approx(1.0 / rate, rel=0.02)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0 / math.sqrt(burstiness), rel=0.03)
    assert (gaps >= 0).all()


def test_infinite_rate_sends_everything_at_once():
    """inf rate: every offset is 0."""
    assert not send_offsets(7, LoadPlan()).any()


def test_offsets_start_at_zero_and_are_seeded():
    """The first request goes at 0, offsets increase, and the seed fixes them."""
    plan = LoadPlan(request_rate=5.0, seed=9)
    offsets = send_offsets(50, plan)
    assert offsets[0] == 0.0 and (np.diff(offsets) >= 0).all()
    assert np.array_equal(offsets, send_offsets(50, plan))
    assert not np.array_equal(offsets, send_offsets(50, LoadPlan(request_rate=5.0, seed=10)))


@pytest.mark.parametrize("kwargs", [{"max_concurrency": 0}, {"request_rate": 0.0},
                                    {"request_rate": float("nan")}, {"burstiness": 0.0}])
def test_bad_plans_are_refused(kwargs):
    """Non-positive concurrency, rate or burstiness is a ValueError."""
    with pytest.raises(ValueError):
        LoadPlan(**kwargs)


def _requests(count: int) -> list[BenchRequest]:
    return [BenchRequest(output_len=1, ignore_eos=True, token_ids=(index + 1,)) for index in range(count)]


async def test_concurrency_cap_is_reached_but_never_exceeded():
    """With max_concurrency 3, at most 3 sends overlap and 3 do at some point; records keep request order."""
    in_flight = 0
    peak = 0

    async def send(request: BenchRequest) -> RequestRecord:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.01)
        in_flight -= 1
        return RequestRecord(prompt_tokens=request.token_ids[0], expected_output_tokens=1)

    done = []
    result = await run_load(_requests(12), send, LoadPlan(max_concurrency=3), on_done=done.append)
    assert peak == 3
    assert [r.prompt_tokens for r in result.records] == list(range(1, 13))
    assert len(done) == 12
    assert result.duration_s >= 4 * 0.01


class _FakeClock:
    """bench.load's perf_counter and asyncio.sleep on a clock that only sleeping advances."""

    def __init__(self) -> None:
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now

    async def sleep(self, delay: float) -> None:
        await asyncio.sleep(0)  # what is ready runs before the time passes, as in a real sleep
        self.now += delay


async def test_request_rate_paces_the_sends(monkeypatch: pytest.MonkeyPatch):
    """At 100 req/s the 20th request is sent about 0.19 s (19 mean gaps) after the first: each request is
    sent exactly at its offset on a fake clock, and never before it on the real one (a loaded machine may
    only make it late, so lateness is not asserted)."""

    async def send(request: BenchRequest) -> RequestRecord:
        return RequestRecord(prompt_tokens=1, expected_output_tokens=1)

    plan = LoadPlan(request_rate=100.0, burstiness=1000.0, seed=1)  # near-regular gaps
    offsets = send_offsets(20, plan).tolist()
    assert offsets[-1] == pytest.approx(0.19, rel=0.1)
    real = await run_load(_requests(20), send, plan)
    starts = [r.start_s for r in real.records]
    assert starts == sorted(starts)
    assert all(start >= offset - 1e-3 for start, offset in zip(starts, offsets)), (starts, offsets)
    clock = _FakeClock()
    monkeypatch.setattr(load, "time", SimpleNamespace(perf_counter=clock.perf_counter))
    monkeypatch.setattr(load, "asyncio", SimpleNamespace(Semaphore=asyncio.Semaphore, create_task=asyncio.create_task,
                                                         gather=asyncio.gather, sleep=clock.sleep))
    faked = await run_load(_requests(20), send, plan)
    assert [r.start_s for r in faked.records] == pytest.approx(offsets, abs=1e-9)
    assert faked.duration_s == pytest.approx(offsets[-1], abs=1e-9)
