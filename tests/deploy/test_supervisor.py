"""The restart policy of `pdserve up` (pure bookkeeping with a fake clock) and the supervisor's decisions
over fake children: backoff doubles with each recent restart, the budget is per time window, and a
process past its budget makes the supervisor give up."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from pdserve.supervisor import GaveUp, RestartBudget, RestartPolicy, Supervisor


def test_backoff_doubles_and_budget_is_per_window():
    """Restarts wait 1, 2, 4 s (capped at backoff_max_s); the 4th death within the window is refused,
    and once the window has passed the budget is whole again."""
    budget = RestartBudget(RestartPolicy(max_restarts=3, window_s=100, backoff_initial_s=1, backoff_max_s=3))
    delays = []
    now = 0.0
    for _ in range(3):
        due = budget.next_restart(now)
        assert due is not None
        delays.append(due - now)
        budget.record(due)
        now = due + 1
    assert delays == [1, 2, 3]
    assert budget.next_restart(now) is None
    assert budget.next_restart(now + 100) == now + 100 + 1


@pytest.mark.parametrize("bad", [dict(max_restarts=-1), dict(window_s=0), dict(backoff_initial_s=0)])
def test_policy_is_validated(bad):
    with pytest.raises(ValueError):
        RestartPolicy(**bad)


@dataclass
class _Process:
    returncode: int | None = None

    def poll(self) -> int | None:
        return self.returncode


@dataclass
class _Child:
    role: str
    process: _Process
    ready_file: Path
    address: str = "unix:/x"

    @property
    def alive(self) -> bool:
        return self.process.poll() is None


@dataclass
class _Cluster:
    children: list[_Child]
    respawned: list[str] = field(default_factory=list)

    def respawn(self, child: _Child) -> None:
        self.respawned.append(child.role)
        child.process = _Process()


def test_supervisor_restarts_after_backoff_then_gives_up(tmp_path):
    """A dead child is restarted only once its backoff has passed; a child that keeps dying past its
    budget raises GaveUp; live children are left alone."""
    clock = [0.0]
    child, other = _Child("decode-0", _Process(-9), tmp_path / "d.addr"), _Child("prefill-0", _Process(), tmp_path / "p.addr")
    cluster = _Cluster([child, other])
    supervisor = Supervisor(cluster, RestartPolicy(max_restarts=2, window_s=600, backoff_initial_s=1),  # type: ignore[arg-type]
                            clock=lambda: clock[0])
    supervisor.check()
    assert cluster.respawned == [] and supervisor.restarting
    clock[0] = 1.0
    supervisor.check()
    assert cluster.respawned == ["decode-0"]
    child.process.returncode = -9
    clock[0] = 2.0
    supervisor.check()
    clock[0] = 4.0
    supervisor.check()
    assert cluster.respawned == ["decode-0", "decode-0"]
    child.process.returncode = 1
    with pytest.raises(GaveUp, match="decode-0"):
        supervisor.check()
