"""PNG of a sweep: output throughput and TTFT / TPOT percentiles against concurrency."""
from __future__ import annotations

from pathlib import Path
from typing import Any

LATENCY_SERIES = (
    ("median_ttft_ms", "TTFT p50"),
    ("p99_ttft_ms", "TTFT p99"),
    ("median_tpot_ms", "TPOT p50"),
    ("p99_tpot_ms", "TPOT p99"),
)


def concurrency_of(result: dict[str, Any]) -> int:
    """The x value: max_concurrency, or num_prompts for an unbounded run (everything in flight)."""
    return int(result.get("max_concurrency") or result.get("num_prompts") or result["completed"])


def plot_sweep(results: list[dict[str, Any]], path: Path, title: str = "") -> None:
    """Left: output tok/s; right: latency percentiles in ms (log scale); x: concurrency (log 2)."""
    if not results:
        raise ValueError("nothing to plot")
    from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend

    ordered = sorted(results, key=concurrency_of)
    xs = [concurrency_of(result) for result in ordered]
    figure = Figure(figsize=(11, 4.2))
    left, right = figure.subplots(1, 2)
    left.plot(xs, [result["output_throughput"] for result in ordered], marker="o", label="output tok/s")
    left.set_ylabel("output tokens / s")
    left.set_ylim(bottom=0)
    left.set_title("Throughput")
    for key, label in LATENCY_SERIES:
        points = [(x, result.get(key)) for x, result in zip(xs, ordered) if result.get(key)]
        if points:
            right.plot(*zip(*points), marker="o", label=label)
    right.set_ylabel("milliseconds")
    right.set_yscale("log")
    right.set_title("Latency percentiles")
    for axis in (left, right):
        axis.set_xlabel("concurrency")
        if len(set(xs)) > 1:
            axis.set_xscale("log", base=2)
        axis.set_xticks(xs, [str(x) for x in xs])
        axis.grid(True, alpha=0.3)
        axis.legend()
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
