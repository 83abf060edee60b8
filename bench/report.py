"""Human and machine output of a run: the summary table (stdout) and one JSON line per run."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

WIDTH = 50
SECTIONS = (
    ("ttft", "Time to First Token", "TTFT"),
    ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"),
    ("itl", "Inter-Token Latency", "ITL"),
    ("e2e_latency", "End-to-End Latency", "E2E Latency"),
)


def json_safe(value: Any) -> Any:
    """inf/nan are not JSON: an infinite request rate is written "inf" (as vllm does), nan as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return "inf" if value > 0 else None
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item) for item in value]
    return value


def append_jsonl(path: Path, result: dict[str, Any]) -> None:
    """Appends one line (creating the file and its folder); the line parses as standard JSON."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as handle:
        handle.write(json.dumps(json_safe(result), allow_nan=False, sort_keys=False) + "\n")


def _row(name: str, value: Any) -> str:
    if value is None:
        shown = "n/a"
    elif isinstance(value, float):
        shown = "inf" if math.isinf(value) else f"{value:.2f}"
    else:
        shown = str(value)
    return f"{name + ':':<40} {shown:<10}"


def _title(text: str, fill: str) -> str:
    return f"{text:{fill}^{WIDTH}}" if text else fill * WIDTH


def prefix_cache_rows(result: dict[str, Any]) -> list[str]:
    """Cached tokens and the hit rate against the workload's achievable one; TTFT p50 / p90 of conversation turns
    >= 2 beside all requests'."""
    rate = result.get("cache_hit_rate")
    lines = [_title("Prefix Cache", "-")]
    lines += [_row(name, value) for name, value in (
        ("Cached prompt tokens", result.get("total_cached_tokens")),
        ("Achievable cached tokens", result.get("total_achievable_cached_tokens")),
        ("Mean cached tokens per request", result.get("mean_cached_tokens")),
        ("Hit rate (cached / achievable, %)", None if rate is None else 100.0 * rate),
    )]
    if result.get("median_ttft_later_turns_ms") is not None:
        for stat, label in (("median", "P50"), ("p90", "P90")):
            lines.append(_row(f"{label} TTFT turns >= 2 / all (ms)",
                              f"{result[f'{stat}_ttft_later_turns_ms']:.2f} / {result[f'{stat}_ttft_ms']:.2f}"))
    return lines


def format_summary(result: dict[str, Any]) -> str:
    """The block sglang's bench_serving prints, plus our goodput / acceptance / cost rows."""
    lines = [_title(" Serving Benchmark Result ", "=")]
    rows = [
        ("Backend", result.get("backend")),
        ("Traffic request rate", result.get("request_rate")),
        ("Burstiness factor", result.get("burstiness")),
        ("Max request concurrency", result.get("max_concurrency") or "unbounded"),
        ("Successful requests", result["completed"]),
        ("Failed requests", result["failed"]),
        ("Benchmark duration (s)", result["duration"]),
        ("Total input tokens", result["total_input_tokens"]),
        ("Total generated tokens", result["total_output_tokens"]),
        ("Request throughput (req/s)", result["request_throughput"]),
        ("Input token throughput (tok/s)", result["input_throughput"]),
        ("Output token throughput (tok/s)", result["output_throughput"]),
        ("Total token throughput (tok/s)", result["total_token_throughput"]),
    ]
    if result.get("goodput") is not None:
        rows += [("Request goodput (req/s)", result["goodput"]), ("Output goodput (tok/s)", result["output_goodput"])]
    rows += [
        ("Accept length", result.get("accept_length")),
        ("Output tok/s per GPU", result["output_throughput_per_gpu"]),
        ("Output tok/s per $/GPU-hour", result.get("output_throughput_per_dollar")),
    ]
    lines += [_row(name, value) for name, value in rows]
    for key, title, short in SECTIONS:
        lines.append(_title(title, "-"))
        for stat, label in (("mean", "Mean"), ("median", "Median"), ("p90", "P90"), ("p99", "P99")):
            lines.append(_row(f"{label} {short} (ms)", result.get(f"{stat}_{key}_ms")))
    if result.get("workload", "random") != "random" or result.get("total_cached_tokens"):
        lines += prefix_cache_rows(result)
    lines.append(_title("", "="))
    return "\n".join(lines)
