"""`pdserve up`'s hang watch (pdserve/hang_watch.py) over real stopped processes with a scripted probe and a fake
clock: a ready worker silent for the limit is killed with its process group (SIGKILL works on a SIGSTOPped one),
once; one that answers again in time, one not ready yet and the gateway are left alone; the supervisor then sees
the killed worker as dead (its ordinary restart path)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdserve.hang_watch import HangPolicy, HangWatch
from pdserve.launcher import Child


def _stopped_child(role: str, tmp_path: Path, ready: bool = True) -> Child:
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    os.killpg(process.pid, signal.SIGSTOP)
    ready_file = tmp_path / f"{role}.ready"
    if ready:
        ready_file.write_text("x")
    return Child(role, process, ready_file, address=f"unix:{tmp_path}/{role}.sock")


def test_a_worker_silent_past_the_limit_is_killed_once(tmp_path):
    now = [0.0]
    answers = {"decode-1": [False, True, False]}  # decode-1 answers in between: its count restarts
    probed: list[str] = []

    def probe(address: str, timeout: float) -> bool:
        role = Path(address.removeprefix("unix:")).stem
        probed.append(role)
        return answers.get(role, [False]).pop(0) if answers.get(role) else False

    children = [_stopped_child("decode-0", tmp_path), _stopped_child("decode-1", tmp_path),
                _stopped_child("prefill-0", tmp_path, ready=False), _stopped_child("gateway", tmp_path)]
    watch = HangWatch(HangPolicy(limit_s=10, probe_interval_s=5), probe=probe, clock=lambda: now[0])
    try:
        killed = []
        for step in range(3):  # t = 0, 5, 10
            now[0] = 5.0 * step
            killed += [child.role for child in watch.check(children)]
        assert killed == ["decode-0"] and watch.killed == 1
        assert "prefill-0" not in probed and "gateway" not in probed
        deadline = time.monotonic() + 30
        while children[0].alive:
            assert time.monotonic() < deadline, "the hung worker was not killed"
            time.sleep(0.05)
        assert children[0].process.returncode == -signal.SIGKILL
        assert all(child.alive for child in children[1:])
        now[0] = 15.0  # decode-0 is dead now: not probed, not killed again
        assert watch.check(children) == [] and watch.killed == 1
    finally:
        for child in children:
            if child.alive:
                os.killpg(child.process.pid, signal.SIGKILL)
            child.process.wait()


def test_limit_zero_never_probes_and_settings_are_checked():
    watch = HangWatch(HangPolicy(limit_s=0), probe=lambda address, timeout: pytest.fail("probed"))
    assert watch.check([]) == []
    with pytest.raises(ValueError, match="limit_s"):
        HangPolicy(limit_s=-1)
    with pytest.raises(ValueError, match="probe_interval_s"):
        HangPolicy(probe_interval_s=0)
