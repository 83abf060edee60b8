"""scripts/gpu_check.sh --dry-run: the device check's Python runs end to end on CPU (tiny sizes), writes its
JSON and markdown, and its real comparisons (fp32 engine vs transformers, the decode benchmark) pass."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_gpu_check_dry_run_writes_its_reports(tmp_path):
    """Every stage is recorded; none fails; GPU-only stages say skipped; the parity stage compared a real
    model (logits within 1e-4, identical greedy tokens) and the benchmark tables (decode, KV handoff) have
    their rows."""
    out = tmp_path / "gpu_check"
    env = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_TIMEOUT_S": "1700"}
    result = subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run", "--budget-s", "1600", str(out)],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((out / "gpu_check.json").read_text())
    statuses = {record["stage"]: record["status"] for record in summary["stages"]}
    assert len(statuses) == 8 and "failed" not in statuses.values(), statuses
    assert statuses["KV handoff benchmark: shm / device / grpc, 8K tokens"] == "passed"
    assert summary["passed"] and summary["environment"]["dry_run"]
    parity = next(r for r in summary["stages"] if r["stage"].startswith("engine vs transformers, fp32"))
    assert parity["status"] == "passed"
    assert all(d["max_abs_diff"] <= 1e-4 and d["greedy_identical"] for d in parity["details"])
    markdown = (out / "gpu_check.md").read_text()
    assert "| stage | status | seconds |" in markdown and "Greedy decode tok/s" in markdown
    assert all(row in markdown for row in ("shm write", "grpc push", "device copy", "device in-place"))
    bench = json.loads((out / "bench_gpu_decode.json").read_text())
    assert set(bench["results"]) == {"1", "2"}
    for row in bench["results"].values():
        assert set(row) == {"engine graphs", "engine eager", "transformers"}
        assert all(variant["tok_s"] > 0 for variant in row.values())


def test_gpu_check_without_gpu_and_without_dry_run_exits_2(tmp_path):
    """On a machine with no GPU the real check refuses in one line (exit 2) instead of pretending."""
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    result = subprocess.run([sys.executable, "scripts/gpu_check.py", str(tmp_path / "out")], cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "no GPU visible" in result.stderr
