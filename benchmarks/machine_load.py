"""How busy the rest of the machine was while a benchmark run ran: the CPU the whole machine spent
(/proc/stat) minus what this process and its descendants spent, per second of the run.

The load average cannot tell the two apart: a deployment of four service processes plus a client loads a
2-core machine above 2 by itself. What makes a run unfit to judge is somebody else's work competing with
it; this measures exactly that (in cores: 0.0 = nobody else ran, 1.0 = one core's worth of other work)."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

import psutil


def machine_busy_seconds() -> float:
    """CPU seconds the machine has spent busy since boot, all cores (user, nice, system, irq, softirq; not
    idle, iowait or time the hypervisor stole)."""
    with open("/proc/stat", encoding="ascii") as stat:
        user, nice, system, _idle, _iowait, irq, softirq = (int(v) for v in stat.readline().split()[1:8])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    """CPU seconds of this process and every living descendant, with the children each of them has waited
    for (a worker's engine process that exited and was reaped still counts, with its parent)."""
    total = 0.0
    me = psutil.Process()
    for process in (me, *me.children(recursive=True)):
        try:
            times = process.cpu_times()
        except psutil.Error:  # exited between the listing and the read
            continue
        total += times.user + times.system + times.children_user + times.children_system
    return total


@dataclass
class OtherLoad:
    """Start before a run, read `cores()` after it."""

    busy: float = 0.0
    own: float = 0.0
    wall: float = 0.0

    def __post_init__(self) -> None:
        self.busy, self.own, self.wall = machine_busy_seconds(), own_cpu_seconds(), time.perf_counter()

    def other_seconds(self) -> float:
        """CPU seconds that processes outside this tree used since the start (>= 0)."""
        return max(0.0, (machine_busy_seconds() - self.busy) - (own_cpu_seconds() - self.own))

    def cores(self) -> float:
        """other_seconds() per second of wall time since the start: cores' worth of other work."""
        wall = time.perf_counter() - self.wall
        return self.other_seconds() / wall if wall > 0 else 0.0
