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
    """Every default stage is recorded with its budget (smoke first: imports, kernels at every head dim,
    one generate); none fails; the budgets fit the 8 minutes; the parity stage compared a real model (logits
    within 1e-4, identical greedy tokens); the benchmark reports (decode, MoE, steps) have their rows and
    goal lines; the log is written beside the JSON."""
    out = tmp_path / "gpu_check"
    env = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_TIMEOUT_S": "1700"}
    result = subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run", "--budget-s", "1600", str(out)],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((out / "gpu_check.json").read_text())
    records = summary["stages"]
    statuses = {record["stage"]: record["status"] for record in records}
    assert len(statuses) == 8 and "failed" not in statuses.values(), statuses
    assert [r["stage"].split(":")[0] for r in records[:3]] == ["smoke"] * 3
    assert all(r["status"] == "passed" for r in records), statuses
    assert sum(r["budget_s"] for r in records if r["stage"] != "engine vs transformers, fp32 tiny configs") <= 480
    assert summary["passed"] and summary["environment"]["dry_run"]
    parity = next(r for r in records if r["stage"].startswith("engine vs transformers, fp32"))
    assert all(d["max_abs_diff"] <= 1e-4 and d["greedy_identical"] for d in parity["details"])
    markdown = (out / "gpu_check.md").read_text()
    assert "| stage | status | seconds | budget |" in markdown and "Greedy decode tok/s" in markdown
    assert "Fused MoE" in markdown and "spec step" in markdown
    assert "[gpu_check] wrote" in (out / "gpu_check.log").read_text()
    bench = json.loads((out / "bench_gpu_decode.json").read_text())
    assert set(bench["results"]) == {"1", "2"}
    for row in bench["results"].values():
        assert set(row) == {"engine graphs", "engine eager", "transformers"}
        assert all(variant["tok_s"] > 0 for variant in row.values())
    steps = json.loads((out / "bench_gpu_steps.json").read_text())
    assert steps["spec_vs_plain"]["spec_step_ms"] > 0 and steps["spec_vs_plain"]["plain_step_ms"] > 0
    assert any(goal.startswith("goal spec step vs plain step") for goal in steps["goals"])


@pytest.mark.slow  # a child interpreter that imports torch: ~2 s of CPU
def test_gpu_check_without_gpu_and_without_dry_run_exits_2(tmp_path):
    """On a machine with no GPU the real check refuses in one line (exit 2) instead of pretending."""
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    result = subprocess.run([sys.executable, "scripts/gpu_check.py", str(tmp_path / "out")], cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "no GPU visible" in result.stderr
