"""Disjoint CPU cores for prefill and decode workers on a CPU node (what separate GPUs give a GPU node).

Without it every worker's torch uses every core, so a prefill forward and a decode step share the cores and an
OpenMP team waits at its barrier for a thread the other process preempted: decode steps stall behind prefill.
`pdserve up` on the CPU gives the decode workers the upper half of the cores it may use (rounded up) and the
prefill workers the lower half, each worker's torch threads = its cores (--num-threads overrides); the gateway
is not pinned. A worker started with --cpus pins every thread of its process, and its engine process and TP
followers inherit the mask; --cpus prefill-half / decode-half name up's halves for workers started on their
own. Pure helpers plus `pin_process`; no torch import."""
from __future__ import annotations

import os
from pathlib import Path


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """'0-3,6' -> (0, 1, 2, 3, 6): sorted, distinct; an empty or malformed list is a ValueError naming it."""
    cpus: set[int] = set()
    for part in text.replace(" ", "").split(","):
        if not part:
            raise ValueError(f"bad CPU list {text!r}: an empty item")
        low, dash, high = part.partition("-")
        try:
            first, last = int(low), int(high) if dash else int(low)
        except ValueError:
            raise ValueError(f"bad CPU list {text!r}: {part!r} is not a CPU number or range") from None
        if first < 0 or last < first:
            raise ValueError(f"bad CPU list {text!r}: {part!r} is not a valid range")
        cpus.update(range(first, last + 1))
    return tuple(sorted(cpus))


def format_cpu_list(cpus: tuple[int, ...]) -> str:
    return ",".join(str(cpu) for cpu in cpus)


def split_cpus(available: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(prefill cores, decode cores): the lower half and the upper half (rounded up) of the cores, or None
    with fewer than 2 (nothing to split)."""
    cpus = tuple(sorted(available))
    if len(cpus) < 2:
        return None
    half = len(cpus) // 2
    return cpus[:half], cpus[half:]


HALVES = ("prefill-half", "decode-half")


def resolve_cpus(text: str, available: tuple[int, ...]) -> tuple[int, ...]:
    """A --cpus / --borrow-cpus value: a CPU list, or prefill-half / decode-half - the half of `available` (the
    CPUs this process may use) that `pdserve up` gives that role, so that a setup without up (the compose
    profile) gets the same split on any machine; () for a half with fewer than 2 CPUs (nothing to split)."""
    if text in HALVES:
        halves = split_cpus(available)
        return halves[HALVES.index(text)] if halves else ()
    return parse_cpu_list(text)


def pin_process(cpus: tuple[int, ...]) -> None:
    """Restricts every thread of this process (and what it starts later) to `cpus`; a CPU this process may not
    use is a ValueError naming it."""
    allowed = os.sched_getaffinity(0)
    outside = [cpu for cpu in cpus if cpu not in allowed]
    if outside:
        raise ValueError(f"--cpus {format_cpu_list(cpus)}: CPU(s) {format_cpu_list(tuple(outside))} not available "
                         f"to this process (allowed: {format_cpu_list(tuple(sorted(allowed)))})")
    for task in Path("/proc/self/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cpus)
        except ProcessLookupError:  # a thread that ended meanwhile
            continue
