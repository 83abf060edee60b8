"""Restarting workers that hang: `pdserve up`'s supervisor asks each ready worker's grpc.health.v1 every
`probe_interval_s` (answered by the worker's event loop); one that has not answered SERVING for `limit_s`
(SIGSTOPped, deadlocked, stuck in a collective) is killed with its process group (SIGKILL), and the supervisor's
ordinary death path restarts it with backoff within its budget (pdserve/supervisor.py). The gateway stops routing
to a hung decode worker long before (gateway/liveness.py, ~4.5 s); this limit is for the process itself.

Invariants: a child is killed at most once per hang; a child not ready yet (starting, restarting) is never
probed, so a slow start is not a hang."""
from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from pdserve.healthcheck import check as health_check
from pdserve.launcher import Child

logger = logging.getLogger(__name__)
WORKER_ROLES = ("prefill-", "decode-")


@dataclass(frozen=True)
class HangPolicy:
    """limit_s: seconds without a SERVING answer before a worker is killed (0: never); a probe waits
    probe_timeout_s and runs every probe_interval_s per worker."""

    limit_s: float = 60.0
    probe_interval_s: float = 5.0
    probe_timeout_s: float = 3.0

    def __post_init__(self) -> None:
        if self.limit_s < 0:
            raise ValueError(f"limit_s must be non-negative, got {self.limit_s}")
        for name in ("probe_interval_s", "probe_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive")


def _probe(address: str, timeout: float) -> bool:
    return health_check(address, timeout=timeout)[0]


class HangWatch:
    """check(children) is called from the supervisor's loop; probe(address, timeout) -> serving?"""

    def __init__(self, policy: HangPolicy, probe: Callable[[str, float], bool] = _probe,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        self._probe = probe
        self._clock = clock
        self._last_probe: dict[str, float] = {}
        self._failing_since: dict[str, float] = {}
        self.killed = 0  # hung workers killed since start

    def check(self, children: Iterable[Child]) -> list[Child]:
        """Probes the ready workers that are due; kills those silent past the limit. Returns those killed."""
        killed: list[Child] = []
        if not self.policy.limit_s:
            return killed
        for child in children:
            role = child.role
            if not role.startswith(WORKER_ROLES) or not child.alive or not child.ready_file.exists():
                self._failing_since.pop(role, None)
                continue
            now = self._clock()
            if now - self._last_probe.get(role, float("-inf")) < self.policy.probe_interval_s:
                continue
            self._last_probe[role] = now
            if self._probe(child.address, self.policy.probe_timeout_s):
                self._failing_since.pop(role, None)
                continue
            since = self._failing_since.setdefault(role, now)
            if now - since >= self.policy.limit_s:
                logger.error("%s has not answered its health probe for %.0f s: killing it (it is restarted)",
                             role, now - since)
                try:
                    os.killpg(child.process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self._failing_since.pop(role, None)
                self.killed += 1
                killed.append(child)
        return killed
