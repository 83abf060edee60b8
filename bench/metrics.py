"""Pure aggregation: per-request records -> the run's metrics (sglang/vllm field names)."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from bench.record import RequestRecord
from bench.slo import SLO

LATENCY_NAMES = ("ttft", "tpot", "itl", "e2e_latency", "ttft_later_turns")


@dataclass(frozen=True)
class Distribution:
    """mean / median / std / p90 / p99 of a list of milliseconds; all None when the list is empty."""

    mean: float | None
    median: float | None
    std: float | None
    p90: float | None
    p99: float | None

    @classmethod
    def of(cls, values_ms: list[float]) -> Distribution:
        if not values_ms:
            return cls(None, None, None, None, None)
        array = np.asarray(values_ms, dtype=np.float64)
        p50, p90, p99 = np.percentile(array, [50, 90, 99])  # linear interpolation, as sglang/vllm
        return cls(float(array.mean()), float(p50), float(array.std()), float(p90), float(p99))


@dataclass(frozen=True)
class BenchMetrics:
    """One run's results. Throughputs are per second of `duration` (first send -> last completion).

    Prefix cache (successful requests): total_cached_tokens (the server's usage reports), mean_cached_tokens per
    request, total_achievable_cached_tokens (what the workload could at best take from a cache:
    bench/prefix_workloads.py), cache_hit_rate = cached / achievable (None when nothing was achievable);
    ttft_later_turns_ms: TTFT of conversation turns >= 2 (empty outside the multi-turn workload)."""

    completed: int
    failed: int
    duration: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    input_throughput: float
    output_throughput: float
    total_token_throughput: float
    ttft_ms: Distribution
    tpot_ms: Distribution
    itl_ms: Distribution
    e2e_latency_ms: Distribution
    goodput: float | None
    output_goodput: float | None
    accept_length: float | None
    output_throughput_per_gpu: float
    output_throughput_per_dollar: float | None
    total_cached_tokens: int = 0
    mean_cached_tokens: float | None = None
    total_achievable_cached_tokens: int = 0
    cache_hit_rate: float | None = None
    ttft_later_turns_ms: Distribution = Distribution(None, None, None, None, None)

    def to_json_dict(self) -> dict[str, float | int | None]:
        """Flat dict: latency distributions become mean_ttft_ms, median_ttft_ms, p90_ttft_ms, ..."""
        flat: dict[str, float | int | None] = {}
        for key, value in asdict(self).items():
            if key.endswith("_ms"):
                name = key[: -len("_ms")]
                for stat, number in value.items():
                    flat[f"{stat}_{name}_ms"] = number
            else:
                flat[key] = value
        flat["request_goodput"] = self.goodput  # vllm's name for the same number
        return flat


def per_dollar(output_throughput: float, gpus: int, gpu_price_per_hour: float | None) -> float | None:
    """tok/s per $/GPU-hour of the whole deployment: output tok/s / (GPUs x $/GPU-hour)."""
    if gpu_price_per_hour is None:
        return None
    return output_throughput / (gpus * gpu_price_per_hour)


def compute_metrics(
    records: list[RequestRecord],
    duration_s: float,
    gpus: int = 1,
    gpu_price_per_hour: float | None = None,
    slo: SLO | None = None,
) -> BenchMetrics:
    """Aggregate; only successful requests count towards tokens, throughput and latencies."""
    if duration_s <= 0 or not math.isfinite(duration_s):
        raise ValueError(f"duration must be positive and finite, got {duration_s!r}")
    if gpus <= 0:
        raise ValueError(f"gpus must be positive, got {gpus!r}")
    done = [record for record in records if record.success]
    input_tokens = sum(record.prompt_tokens for record in done)
    output_tokens = sum(record.output_tokens for record in done)
    output_throughput = output_tokens / duration_s
    tpots = [record.tpot_s for record in done if record.tpot_s is not None]
    accept = [record.accept_length for record in done if record.accept_length]
    goodput = output_goodput = None
    if slo is not None and slo.bounds:
        good = [record for record in done if slo.met_by(record)]
        goodput = len(good) / duration_s
        output_goodput = sum(record.output_tokens for record in good) / duration_s
    cached = sum(record.cached_tokens for record in done)
    achievable = sum(record.achievable_cached_tokens for record in done)
    return BenchMetrics(
        completed=len(done),
        failed=len(records) - len(done),
        duration=duration_s,
        total_input_tokens=input_tokens,
        total_output_tokens=output_tokens,
        request_throughput=len(done) / duration_s,
        input_throughput=input_tokens / duration_s,
        output_throughput=output_throughput,
        total_token_throughput=(input_tokens + output_tokens) / duration_s,
        ttft_ms=Distribution.of([record.ttft_s * 1000 for record in done if record.output_tokens > 0]),
        tpot_ms=Distribution.of([value * 1000 for value in tpots]),
        itl_ms=Distribution.of([value * 1000 for record in done for value in record.itl_s]),
        e2e_latency_ms=Distribution.of([record.e2e_s * 1000 for record in done]),
        goodput=goodput,
        output_goodput=output_goodput,
        accept_length=float(np.mean(accept)) if accept else None,
        output_throughput_per_gpu=output_throughput / gpus,
        output_throughput_per_dollar=per_dollar(output_throughput, gpus, gpu_price_per_hour),
        total_cached_tokens=cached,
        mean_cached_tokens=cached / len(done) if done else None,
        total_achievable_cached_tokens=achievable,
        cache_hit_rate=cached / achievable if achievable else None,
        ttft_later_turns_ms=Distribution.of([record.ttft_s * 1000 for record in done
                                             if record.turn >= 2 and record.output_tokens > 0]),
    )
