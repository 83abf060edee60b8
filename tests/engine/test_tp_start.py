"""Starting TP ranks from the ways people first call the offline API, in a fresh interpreter each, under a
deadline: a script with no `if __name__ == "__main__":` guard, `python -c`, a notebook-like exec of a cell. Each
either generates what TP=1 generates or, when a rank cannot start, raises TPStartError naming the rank; either way
the interpreter exits by itself (no rank, thread or zombie left: its own check, then no process carrying this
run's marker in its environment is alive afterwards)."""
from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

from engine import LLM, SamplingParams
from engine.paths import DEFAULT_MODEL_DIR

REPO = Path(__file__).resolve().parents[2]
DEADLINE_S = 60  # the bound for each case, start to exit
PROMPT = [5, 6, 7, 8, 9]
GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)

# What every case ends with: the caller's own view of what it left behind.
EPILOGUE = """
import threading, psutil
print("LEFT", len(psutil.Process().children(recursive=True)), threading.active_count() - BASE_THREADS)
"""
GENERATE = """
import threading
BASE_THREADS = threading.active_count()
from engine import LLM, SamplingParams
llm = LLM(tp_size=2, attention_backend="torch", draft_model="")
print("TOKENS", llm.generate([PROMPT], SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True))[0])
llm.close()
"""
# A second thread first (as in a notebook kernel or after numpy's thread pool started): no fork, a fresh child.
SECOND_THREAD = "import threading\nthreading.Thread(target=threading.Event().wait, daemon=True).start()\n"
EXPECT_FAILURE = """
import threading
BASE_THREADS = threading.active_count()
from engine import LLM
from engine.runtime.tp_launcher import TPStartError
try:
    LLM(tp_size=2, attention_backend="torch", draft_model="")
except TPStartError as error:
    print("ERROR", error)
"""
# A follower interpreter that dies before it joins the group.
DYING_CHILD = "import engine.runtime.tp_start\nengine.runtime.tp_start.ENTRY_CODE = 'import sys; sys.exit(3)'\n"
# A forked follower whose load raises (the leader loads fine).
FAILING_LOAD = """
import engine.runtime.tp_launcher as launcher
from rpc.processes import child_start_method
assert child_start_method("cpu") == "fork", "this case needs a one-thread leader"
class Failing(launcher.ModelRunner):
    def __init__(self, config, tp):
        if tp.rank:
            raise RuntimeError("injected load failure")
        super().__init__(config, tp)
launcher.ModelRunner = Failing
"""
# The leader's join of the group fails as gloo fails it when a follower closes its connection mid-join.
LEADER_JOIN_BREAKS = """
_join = launcher._init_group
def _breaking_join(rank, size, store, config):
    group = _join(rank, size, store, config)
    if rank == 0:
        raise RuntimeError("Gloo connectFullMesh failed with ... Connection closed by peer [127.0.0.1]:1")
    return group
launcher._init_group = _breaking_join
"""


@pytest.fixture(scope="module")
def expected() -> list[int]:
    with LLM(str(DEFAULT_MODEL_DIR), attention_backend="torch", draft_model="") as llm:
        return llm.generate([PROMPT], GREEDY)[0]


def _run(argv: list[str], tmp_path: Path, stdin: str | None = None, single_thread: bool = False) -> str:
    """Runs argv under the deadline; asserts it exited 0 by itself and that nothing it started is alive."""
    marker = uuid.uuid4().hex
    env = {**os.environ, "PYTHONPATH": str(REPO), "PDSERVE_TEST_MARKER": marker}
    if single_thread:
        env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    result = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=DEADLINE_S, env=env,
                            cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    deadline = time.monotonic() + 30  # a SIGKILLed orphan is reaped by init a moment later
    while _marked(marker):
        assert time.monotonic() < deadline, f"left behind: {_marked(marker)}"
        time.sleep(0.1)
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines() if " " in line)
    assert lines.get("LEFT") == "0 0", result.stdout  # no child process, no thread beyond the caller's own
    return result.stdout


def _marked(marker: str) -> list[int]:
    found = []
    for process in psutil.process_iter():
        try:
            if process.environ().get("PDSERVE_TEST_MARKER") == marker and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def _tokens(stdout: str) -> list[int]:
    line = next(line for line in stdout.splitlines() if line.startswith("TOKENS "))
    return [int(token) for token in line[len("TOKENS ["):-1].split(",")]


def _code(*parts: str) -> str:
    return f"PROMPT = {PROMPT}\n" + "".join(parts) + EPILOGUE


@pytest.mark.slow  # three fresh interpreters with TP=2 each
def test_no_main_guard_script_python_c_and_notebook_cell_generate_like_tp1(tmp_path, expected):
    """A script file without a main guard (followers in fresh interpreters: a second thread runs), the same
    code through `python -c` (one thread: forked followers) and exec'd as a notebook cell: TP=1's tokens."""
    script = tmp_path / "first_try.py"
    script.write_text(_code(SECOND_THREAD, GENERATE))
    assert _tokens(_run([sys.executable, str(script)], tmp_path)) == expected
    assert _tokens(_run([sys.executable, "-c", _code(GENERATE)], tmp_path, single_thread=True)) == expected
    cell = "import sys; exec(compile(sys.stdin.read(), '<ipython-input-1>', 'exec'), {'__name__': '__main__'})"
    assert _tokens(_run([sys.executable, "-c", cell], tmp_path, stdin=_code(SECOND_THREAD, GENERATE))) == expected


@pytest.mark.slow
def test_a_follower_that_dies_before_joining_raises_in_the_caller(tmp_path):
    """A follower interpreter that exits at once: TPStartError names the rank and its exit code, long before
    any collective timeout, and the caller exits cleanly."""
    script = tmp_path / "dies.py"
    script.write_text(_code(SECOND_THREAD, DYING_CHILD, EXPECT_FAILURE))
    stdout = _run([sys.executable, str(script)], tmp_path)
    assert "ERROR TP rank 1 exited with code 3 while starting" in stdout, stdout


@pytest.mark.slow
def test_a_follower_whose_load_fails_raises_its_error_in_the_caller(tmp_path):
    """A forked follower whose model load raises: TPStartError carries the follower's own error text."""
    stdout = _run([sys.executable, "-c", _code(FAILING_LOAD, EXPECT_FAILURE)], tmp_path, single_thread=True)
    assert "ERROR TP rank 1 failed while" in stdout, stdout
    assert "RuntimeError: injected load failure" in stdout, stdout


@pytest.mark.slow
def test_the_leader_sees_the_follower_error_when_its_own_join_breaks_first(tmp_path):
    """The follower joins and dies loading while the leader is still joining the group: gloo fails the leader's
    join ("Connection closed by peer", as a CI run once saw); the caller still gets TPStartError with the
    follower's own error text, not gloo's. (The leader's join is made to fail so, every time.)"""
    stdout = _run([sys.executable, "-c", _code(FAILING_LOAD, LEADER_JOIN_BREAKS, EXPECT_FAILURE)], tmp_path,
                  single_thread=True)
    assert "ERROR TP rank 1 failed while" in stdout, stdout
    assert "RuntimeError: injected load failure" in stdout, stdout
    assert "connectFullMesh" not in stdout, stdout
