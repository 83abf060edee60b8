"""Metric aggregation: percentiles, TPOT / ITL, goodput under an SLO, throughput per GPU and per dollar."""
from __future__ import annotations

import math

import numpy as np
import pytest

from bench.metrics import Distribution, compute_metrics, per_dollar
from bench.record import RequestRecord, spread_chunk_gaps
from bench.slo import SLO


def record(ttft: float, e2e: float, tokens: int, prompt: int = 10, itl: list[float] | None = None,
           error: str = "", accept: float | None = None) -> RequestRecord:
    return RequestRecord(prompt_tokens=prompt, expected_output_tokens=tokens, output_tokens=tokens, ttft_s=ttft,
                         e2e_s=e2e, itl_s=itl or [], error=error, accept_length=accept)


def test_distribution_matches_linear_interpolation_percentiles():
    """p50 / p90 / p99 interpolate linearly between order statistics (numpy's default, as sglang/vllm)."""
    values = [float(v) for v in range(1, 101)]  # 1..100
    stats = Distribution.of(values)
    assert stats.mean == pytest.approx(50.5)
    assert stats.median == pytest.approx(50.5)
    assert stats.p90 == pytest.approx(90.1)  # rank 0.9 * 99 = 89.1 -> 90 + 0.1
    assert stats.p99 == pytest.approx(99.01)
    assert stats.std == pytest.approx(np.std(values))
    assert Distribution.of([]).median is None


def test_tpot_excludes_first_token_and_needs_two_tokens():
    """TPOT = (e2e - ttft) / (tokens - 1); a one-token request has none and is left out of the mean."""
    assert record(0.1, 1.1, 11).tpot_s == pytest.approx(0.1)
    assert record(0.1, 0.1, 1).tpot_s is None
    metrics = compute_metrics([record(0.1, 1.1, 11), record(0.2, 0.2, 1), record(0.1, 2.1, 5)], duration_s=3.0)
    assert metrics.tpot_ms.mean == pytest.approx((100.0 + 500.0) / 2)


def test_itl_spreads_multi_token_chunks_evenly():
    """A chunk of n tokens arriving g after the previous one gives n gaps of g/n; empty chunks are skipped;
    extra tokens of the first chunk add nothing, so sum(itl) = last chunk time - first chunk time."""
    times = [0.5, 0.6, 0.7, 1.0, 1.3]
    tokens = [2, 1, 0, 3, 1]
    itl = spread_chunk_gaps(times, tokens)
    assert itl == pytest.approx([0.1, 0.4 / 3, 0.4 / 3, 0.4 / 3, 0.3])  # 1.0 - 0.6: the empty chunk is not a token
    assert sum(itl) == pytest.approx(times[-1] - times[0])
    assert len(itl) == sum(tokens) - tokens[0]


def test_throughputs_count_only_successful_requests():
    """Tokens and latencies come from completed requests; failures only count as failed."""
    ok = [record(0.1, 1.0, 10, prompt=100), record(0.3, 2.0, 20, prompt=50)]
    bad = record(0.0, 0.5, 0, prompt=70, error="UNAVAILABLE: gone")
    metrics = compute_metrics(ok + [bad], duration_s=2.0)
    assert (metrics.completed, metrics.failed) == (2, 1)
    assert metrics.total_input_tokens == 150 and metrics.total_output_tokens == 30
    assert metrics.output_throughput == pytest.approx(15.0)
    assert metrics.input_throughput == pytest.approx(75.0)
    assert metrics.total_token_throughput == pytest.approx(90.0)
    assert metrics.request_throughput == pytest.approx(1.0)
    assert metrics.ttft_ms.mean == pytest.approx(200.0)
    assert metrics.e2e_latency_ms.median == pytest.approx(1500.0)


def test_goodput_requires_every_bound():
    """Goodput counts requests meeting all given bounds, per second and as output tok/s."""
    records = [
        record(0.1, 1.1, 11),  # ttft 100, tpot 100
        record(0.4, 1.4, 11),  # ttft 400: misses ttft bound
        record(0.1, 3.1, 11),  # tpot 300: misses tpot bound
        record(0.2, 0.2, 1),   # no TPOT: meets the tpot bound
    ]
    metrics = compute_metrics(records, duration_s=2.0, slo=SLO(ttft_ms=250, tpot_ms=150))
    assert metrics.goodput == pytest.approx(2 / 2.0)
    assert metrics.output_goodput == pytest.approx((11 + 1) / 2.0)
    assert compute_metrics(records, duration_s=2.0).goodput is None
    tight = compute_metrics(records, duration_s=2.0, slo=SLO(e2e_ms=1000))
    assert tight.goodput == pytest.approx(1 / 2.0)


def test_per_gpu_and_per_dollar_match_the_seed_figure():
    """952 tok/s on 8 GPUs at $2.50/GPU-hour is 119 tok/s per GPU and 47.6 tok/s per $/GPU-hour."""
    assert per_dollar(952.0, 8, 2.50) == pytest.approx(47.6)
    assert per_dollar(952.0, 8, None) is None
    metrics = compute_metrics([record(0.1, 1.0, 952)], duration_s=1.0, gpus=8, gpu_price_per_hour=2.50)
    assert metrics.output_throughput_per_gpu == pytest.approx(119.0)
    assert metrics.output_throughput_per_dollar == pytest.approx(47.6)


def test_accept_length_averages_reporting_requests():
    """accept_length is the mean of the server's per-request stat over requests that reported one."""
    records = [record(0.1, 1, 5, accept=2.0), record(0.1, 1, 5, accept=3.0), record(0.1, 1, 5)]
    assert compute_metrics(records, 1.0).accept_length == pytest.approx(2.5)
    assert compute_metrics([record(0.1, 1, 5)], 1.0).accept_length is None


def test_json_dict_uses_sglang_vllm_names():
    """The flat dict has mean/median/std/p90/p99 for ttft, tpot, itl and e2e_latency, all finite here."""
    flat = compute_metrics([record(0.1, 1.0, 10, itl=[0.1] * 9)], 1.0).to_json_dict()
    for name in ("ttft", "tpot", "itl", "e2e_latency"):
        for stat in ("mean", "median", "std", "p90", "p99"):
            assert math.isfinite(flat[f"{stat}_{name}_ms"])
    for key in ("completed", "failed", "duration", "request_throughput", "input_throughput", "output_throughput",
                "total_token_throughput", "total_input_tokens", "total_output_tokens", "request_goodput"):
        assert key in flat
    assert flat["mean_itl_ms"] == pytest.approx(100.0)


def test_rejects_nonpositive_duration():
    """A run of zero duration has no throughput."""
    with pytest.raises(ValueError):
        compute_metrics([], duration_s=0.0)
