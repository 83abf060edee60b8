"""rpc.processes: a child's start time names it and turns 0 once it is gone; group and descendant queries see
living processes only; die_with_parent makes the kernel signal an orphaned child."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rpc.processes import alive, cpu_seconds, descendants, group_members, start_ticks

SLEEPER = [sys.executable, "-c", "import sys; sys.stdin.read()"]


def test_start_time_alive_and_group_follow_a_child() -> None:
    """A live child: its start time in ticks since boot as the kernel records it, alive, a member of its own new group and our descendant;
    after it is reaped, start time 0 and not alive."""
    child = subprocess.Popen(SLEEPER, stdin=subprocess.PIPE, start_new_session=True)
    try:
        started = start_ticks(child.pid)
        with open(f"/proc/{child.pid}/stat") as stat:  # the kernel's own record of it
            assert started == int(stat.read().rsplit(")", 1)[1].split()[19])
        assert start_ticks(child.pid) == started  # stable: names this incarnation
        assert alive({child.pid}) == {child.pid}
        assert group_members(child.pid) == {child.pid}
        assert child.pid in descendants(os.getpid())
    finally:
        child.stdin.close()
        child.wait(timeout=30)
    assert start_ticks(child.pid) == 0 and alive({child.pid}) == set() and group_members(child.pid) == set()


def test_cpu_seconds_grows_with_work() -> None:
    """Our own CPU time increases after a busy loop."""
    before = cpu_seconds(os.getpid())
    deadline = time.process_time() + 0.05
    while time.process_time() < deadline:
        pass
    assert cpu_seconds(os.getpid()) > before


ORPHAN = """
import os, signal, subprocess, sys
child = subprocess.Popen([sys.executable, "-c",
    "import signal, sys; from rpc.processes import die_with_parent; assert die_with_parent(signal.SIGKILL); "
    "print('ready', flush=True); sys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
assert child.stdout.readline() == "ready\\n"
print(child.pid, flush=True)
os._exit(0)  # dies without closing the child's stdin: only the death signal can end the child
"""


def test_die_with_parent_kills_the_orphan() -> None:
    """A grandchild that asked for SIGKILL on its parent's death is gone soon after that parent exits."""
    parent = subprocess.run([sys.executable, "-c", ORPHAN], capture_output=True, text=True, timeout=60, check=True)
    grandchild = int(parent.stdout.split()[-1])
    deadline = time.monotonic() + 30
    while alive({grandchild}):
        assert time.monotonic() < deadline, "the orphan outlived its parent"
        time.sleep(0.05)


FORK_PROBE = """
import os, signal, socket, sys, threading
from rpc.processes import child_start_method, forget_parent_signals
print(child_start_method("cpu"), child_start_method("cuda"))
signal.signal(signal.SIGTERM, lambda *_: None)
signal.signal(signal.SIGHUP, signal.SIG_IGN)
interrupt = signal.getsignal(signal.SIGINT)  # Python's KeyboardInterrupt handler, or SIG_IGN if we inherited that
reader, writer = socket.socketpair()
writer.setblocking(False)
signal.set_wakeup_fd(writer.fileno())
pid = os.fork()
if pid == 0:
    forget_parent_signals()
    ok = (signal.getsignal(signal.SIGTERM) is signal.SIG_DFL and signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
          and signal.set_wakeup_fd(-1) == -1 and signal.getsignal(signal.SIGINT) is interrupt)
    os._exit(0 if ok else 1)
print("child", os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
threading.Thread(target=threading.Event().wait, daemon=True).start()
print(child_start_method("cpu"))
"""


def test_fork_only_while_single_threaded_on_the_cpu_and_the_child_forgets_our_signals() -> None:
    """child_start_method: "fork" for a CPU child of a one-thread process, "spawn" for a GPU child or once a
    second thread runs; forget_parent_signals leaves a forked child with default handlers where the parent
    had Python ones, still ignoring what the parent ignored, and no asyncio-style wake-up fd."""
    result = subprocess.run([sys.executable, "-c", FORK_PROBE], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:3] == ["fork spawn", "child 0", "spawn"], result.stdout


AFTER_CLI_START = """
import sys
from pdserve import cli
try:
    cli.main(["plan", "--help"])
except SystemExit:
    pass
import numpy, torch
from rpc.processes import child_start_method
print(child_start_method("cpu"))
"""


@pytest.mark.slow  # a child interpreter that imports torch: ~2.5 s of CPU
def test_a_pdserve_process_can_fork_its_engine_children_without_thread_settings() -> None:
    """With no OMP_NUM_THREADS / OPENBLAS_NUM_THREADS in the environment (as under `pdserve up` from a
    shell), a pdserve command that then imports numpy and torch still has one thread, so its decode engine
    process and TP followers are forked: the CLI keeps numpy's OpenBLAS from starting its thread pool."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    result = subprocess.run([sys.executable, "-c", AFTER_CLI_START], capture_output=True, text=True, timeout=300,
                            env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "fork", result.stdout
