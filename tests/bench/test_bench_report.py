"""Output: the summary table, JSON lines that stay standard JSON, the sweep plot, the progress bar, SLO parsing."""
from __future__ import annotations

import io
import json
import math

import pytest

from bench.config import parse_sweep
from bench.metrics import compute_metrics
from bench.plot import plot_sweep
from bench.progress import ProgressBar
from bench.record import RequestRecord
from bench.report import append_jsonl, format_summary
from bench.slo import SLO


def _result(concurrency: int, throughput_scale: float = 1.0) -> dict:
    records = [RequestRecord(prompt_tokens=8, expected_output_tokens=4, output_tokens=4, ttft_s=0.01 * concurrency,
                             e2e_s=0.05 * concurrency, itl_s=[0.01 * concurrency] * 3)]
    metrics = compute_metrics(records, duration_s=1.0 / throughput_scale)
    return {"backend": "pdserve", "request_rate": math.inf, "max_concurrency": concurrency, **metrics.to_json_dict()}


def test_summary_has_the_sglang_block_and_values():
    """The table starts with the sglang header, shows throughput with 2 decimals and every latency section."""
    text = format_summary(_result(2, throughput_scale=2.0))
    lines = text.splitlines()
    assert lines[0] == "============ Serving Benchmark Result ============"
    assert lines[-1] == "=" * 50
    assert any(line.startswith("Output token throughput (tok/s):") and line.split()[-1] == "8.00" for line in lines)
    for title in ("Time to First Token", "Time per Output Token (excl. 1st token)", "Inter-Token Latency",
                  "End-to-End Latency"):
        assert any(title in line for line in lines)
    assert any(line.startswith("P99 TTFT (ms):") and line.split()[-1] == "20.00" for line in lines)
    assert any(line.startswith("Traffic request rate:") and line.split()[-1] == "inf" for line in lines)


def test_jsonl_appends_standard_json(tmp_path):
    """Each call appends one line; an infinite rate is written "inf" and the line parses strictly."""
    path = tmp_path / "sub" / "runs.jsonl"
    append_jsonl(path, _result(1))
    append_jsonl(path, _result(4))
    lines = path.read_text().splitlines()
    assert len(lines) == 2
    parsed = [json.loads(line, parse_constant=lambda name: pytest.fail(f"non-standard JSON constant {name}"))
              for line in lines]
    assert [p["max_concurrency"] for p in parsed] == [1, 4]
    assert parsed[0]["request_rate"] == "inf"


def test_plot_writes_a_png(tmp_path):
    """A three-point sweep renders to a non-trivial PNG file."""
    path = tmp_path / "plot.png"
    plot_sweep([_result(4, 3.0), _result(1, 1.0), _result(16, 5.0)], path, title="test")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    with pytest.raises(ValueError):
        plot_sweep([], path)


def test_progress_bar_counts_and_writes_final_line():
    """On a non-terminal stream only the final state is written, with done / total and failures."""
    stream = io.StringIO()
    bar = ProgressBar(4, label="c=2", stream=stream)
    for failed in (False, True, False, False):
        bar.update(failed=failed)
    assert stream.getvalue() == ""
    bar.close()
    bar.close()
    output = stream.getvalue()
    assert output.count("\n") == 1
    assert output.startswith("c=2: 4/4 failed 1 ")


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_draws_with_tqdm_on_a_terminal():
    """On a terminal the bar (tqdm) shows the label, done / total and the failure count as it goes."""
    stream = _Terminal()
    bar = ProgressBar(4, label="c=2", stream=stream)
    for failed in (False, True, False, False):
        bar.update(failed=failed)
    bar.close()
    final = stream.getvalue().split("\r")[-1]
    assert final.startswith("c=2: 100%") and "4/4" in final and "failed=1" in final


def test_slo_parse_and_errors():
    """key=ms pairs parse to bounds; unknown keys, repeats, non-numbers and non-positive values are refused."""
    assert SLO.parse("ttft_ms=200, tpot_ms=50").bounds == {"ttft_ms": 200.0, "tpot_ms": 50.0}
    for bad in ("ttft=5", "ttft_ms=5,ttft_ms=6", "e2e_ms=abc", "tpot_ms=0", "", "ttft_ms"):
        with pytest.raises(ValueError):
            SLO.parse(bad)


def test_sweep_parse():
    """'1,4,16,64' parses in order; zero, junk and repeats are refused."""
    assert parse_sweep("1,4,16,64") == (1, 4, 16, 64)
    for bad in ("0,1", "1,,2", "a", "4,4", "-1"):
        with pytest.raises(ValueError):
            parse_sweep(bad)
