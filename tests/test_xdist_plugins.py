"""The suite's own pytest plugins under pytest-xdist: tests/xdist_order.py (slow scopes handed out first) and
tests/cpu_durations.py (CPU seconds reported across workers). Each runs a child pytest on generated tests."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cpu_durations import Usage, scope_costs

pytest.importorskip("xdist")

REPO = Path(__file__).resolve().parents[1]
FAST = "def test_fast_{i}():\n    assert True\n"
SLOW = "import pytest\n\n\n@pytest.mark.slow\ndef test_slow_0():\n    assert True\n\n\ndef test_slow_1():\n    assert True\n"


def _child_pytest(root: Path, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("PYTEST_XDIST_WORKER", None)  # the child is a fresh controller, even when this test runs in a worker
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:hypothesispytest",  # ~1 s per process
         "-p", "tests.xdist_order", "-p", "tests.cpu_durations",
         "-o", "markers=slow: slow", "--rootdir", str(root), *args, str(root)],
        cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


@pytest.mark.slow  # a child pytest with two xdist workers: a few seconds of CPU
def test_slow_scopes_run_first_and_cpu_durations_cover_every_worker(tmp_path: Path):
    """With one worker the scheduler's order is visible: the module holding a `slow` test (collected last) runs
    before the fast modules, its two tests together and in their own order. With two workers the CPU summary
    lists every test once, whichever worker ran it."""
    (tmp_path / "test_a.py").write_text("\n\n".join(FAST.format(i=i) for i in range(3)))
    (tmp_path / "test_b.py").write_text(FAST.format(i=9))
    (tmp_path / "test_z.py").write_text(SLOW)
    order = _child_pytest(tmp_path, "-n", "1", "--dist", "loadscope", "--no-loadscope-reorder", "-v")
    ran = [line.split("PASSED ")[1].split("::")[1].strip() for line in order.splitlines() if "PASSED " in line]
    assert ran == ["test_slow_0", "test_slow_1", "test_fast_0", "test_fast_1", "test_fast_2", "test_fast_9"], ran

    summary = _child_pytest(tmp_path, "-n", "2", "--dist", "loadscope", "--cpu-durations=0")
    listed = [line.split()[-1] for line in summary.splitlines() if " cpu " in line and " wall " in line]
    assert sorted(listed) == sorted(f"test_{m}.py::test_{n}" for m, n in
                                    [("a", "fast_0"), ("a", "fast_1"), ("a", "fast_2"), ("b", "fast_9"),
                                     ("z", "slow_0"), ("z", "slow_1")]), summary
    assert "over 6 tests" in summary


@pytest.mark.slow  # two child pytests: a few seconds of CPU
def test_slow_scopes_go_longest_first_and_their_costs_can_be_recorded(tmp_path: Path):
    """Slow scopes are handed out by the recorded wall seconds, longest first (an unlisted slow scope counts
    as DEFAULT_COST_S), then the fast ones; --write-scope-costs records every scope's wall seconds."""
    (tmp_path / "test_a.py").write_text(FAST.format(i=0))
    for name in ("m", "n", "o"):
        (tmp_path / f"test_{name}.py").write_text(f"import pytest\n\n\n@pytest.mark.slow\ndef test_{name}():\n    assert True\n")
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"test_m.py": 1.0, "test_n.py": 99.0}))  # test_o.py unlisted: 10 s
    order = _child_pytest(tmp_path, "-n", "1", "--dist", "loadscope", "--no-loadscope-reorder", "-v",
                          "--scope-costs", str(costs))
    ran = [line.split("PASSED ")[1].split("::")[1].strip() for line in order.splitlines() if "PASSED " in line]
    assert ran == ["test_n", "test_o", "test_m", "test_fast_0"], ran

    written = tmp_path / "written.json"
    _child_pytest(tmp_path, "-n", "2", "--dist", "loadscope", "--write-scope-costs", str(written))
    assert json.loads(written.read_text()) == {}  # only scopes of >= 1 s are kept: none of these


def test_scope_costs_sum_a_scopes_tests_and_drop_short_scopes():
    """Wall seconds add up per xdist scope (module, or class), longest first, scopes under 1 s left out."""
    usages = [Usage("t/test_a.py::test_x", wall_s=0.7), Usage("t/test_a.py::test_y", wall_s=0.6),
              Usage("t/test_b.py::Cls::test_z", wall_s=5.0), Usage("t/test_c.py::test_w", wall_s=0.2)]
    assert scope_costs(usages) == {"t/test_b.py::Cls": 5.0, "t/test_a.py": 1.3}


def test_the_session_cluster_unit_names_every_module_that_takes_the_cluster():
    """tests/xdist_order.py's SESSION_CLUSTER_MODULES (one xdist work unit, so the session deployment starts
    once per run) are exactly the test modules with a test or fixture taking the `cluster` fixture; a module
    left out would only start a second deployment, one listed wrongly would only lengthen the unit."""
    import ast

    from tests.xdist_order import SESSION_CLUSTER_MODULES, SESSION_CLUSTER_SCOPE, scope_of

    taking = set()
    for path in sorted((REPO / "tests").rglob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            fixture = any("fixture" in ast.unparse(decorator) for decorator in node.decorator_list)
            if (node.name.startswith("test_") or fixture) and "cluster" in [a.arg for a in node.args.args]:
                taking.add(path.relative_to(REPO).as_posix())
    assert taking == set(SESSION_CLUSTER_MODULES)
    assert scope_of("tests/services/test_e2e_api.py::test_x[a]") == SESSION_CLUSTER_SCOPE
    assert scope_of("tests/engine/test_llm.py::Cls::test_y") == "tests/engine/test_llm.py::Cls"
