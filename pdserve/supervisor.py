"""Keeping a `pdserve up` deployment alive: a process that dies is started again on its old address,
after a backoff that doubles with each recent restart, within a restart budget per time window; past
the budget the supervisor gives up loudly (and `pdserve up` stops everything). A worker that hangs past a limit
is killed first (pdserve/hang_watch.py), so it is restarted the same way."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.hang_watch import HangWatch
from pdserve.launcher import Child, Cluster

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RestartPolicy:
    """max_restarts per process within window_s; the n-th recent restart waits
    min(backoff_max_s, backoff_initial_s * 2**(n-1))."""

    max_restarts: int = 5
    window_s: float = 600.0
    backoff_initial_s: float = 1.0
    backoff_max_s: float = 30.0

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError("max_restarts must be non-negative")
        for name in ("window_s", "backoff_initial_s", "backoff_max_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive")


@dataclass
class RestartBudget:
    """One process's restarts (pure bookkeeping, clock passed in)."""

    policy: RestartPolicy
    restarts: list[float] = field(default_factory=list)  # times of the restarts within the window

    def next_restart(self, now: float) -> float | None:
        """When the process that just died may start again, or None when its budget is spent."""
        self.restarts = [t for t in self.restarts if now - t < self.policy.window_s]
        if len(self.restarts) >= self.policy.max_restarts:
            return None
        delay = min(self.policy.backoff_max_s, self.policy.backoff_initial_s * 2 ** len(self.restarts))
        return now + delay

    def record(self, now: float) -> None:
        self.restarts.append(now)


class GaveUp(RuntimeError):
    """A process kept dying past its restart budget."""


class Supervisor:
    """check() is called periodically (the `pdserve up` loop): schedules restarts of dead children,
    performs those that are due, and notes when a restarted child is ready again."""

    def __init__(self, cluster: Cluster, policy: RestartPolicy = RestartPolicy(),
                 clock: Callable[[], float] = time.monotonic, hang_watch: HangWatch | None = None) -> None:
        self.cluster = cluster
        self.hang_watch = hang_watch  # kills workers hung past a limit (pdserve/hang_watch.py): then restarted
        self.policy = policy
        self._clock = clock
        self._budgets: dict[str, RestartBudget] = {}
        self._due: dict[str, float] = {}
        self._coming_back: set[str] = set()

    def check(self) -> None:
        if self.hang_watch is not None:
            self.hang_watch.check(self.cluster.children)
        now = self._clock()
        for child in self.cluster.children:
            if child.alive:
                self._note_ready(child)
            elif child.role not in self._due:
                self._schedule(child, now)
            elif now >= self._due[child.role]:
                del self._due[child.role]
                self._budgets[child.role].record(now)
                self.cluster.respawn(child)
                self._coming_back.add(child.role)

    def _schedule(self, child: Child, now: float) -> None:
        budget = self._budgets.setdefault(child.role, RestartBudget(self.policy))
        due = budget.next_restart(now)
        code = child.process.returncode
        if due is None:
            logger.error("%s exited with code %s and has used its %d restarts in %.0f s: GIVING UP",
                         child.role, code, self.policy.max_restarts, self.policy.window_s)
            raise GaveUp(f"{child.role} keeps dying (exit code {code}); restart budget spent")
        self._due[child.role] = due
        logger.warning("%s exited with code %s; restarting it in %.1f s (restart %d of %d allowed in %.0f s)",
                       child.role, code, due - now, len(budget.restarts) + 1, self.policy.max_restarts,
                       self.policy.window_s)

    def _note_ready(self, child: Child) -> None:
        if child.role in self._coming_back and child.ready_file.exists():
            self._coming_back.discard(child.role)
            logger.info("%s is back on %s", child.role, child.address)

    @property
    def restarting(self) -> bool:
        """True while some child is dead and waiting for its restart, or restarted but not ready yet."""
        return bool(self._due or self._coming_back)
