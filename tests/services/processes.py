"""Looking at processes and shared memory from outside (Linux /proc), for shutdown tests."""
from __future__ import annotations

import os
import re
from pathlib import Path

_SHM_PATTERN = re.compile(r"/dev/shm/(pdserve-kv-[0-9a-f]+)")


def _stat(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()  # fields after the command name: state, ppid, pgrp, ...


def descendants(root: int) -> set[int]:
    """root's living descendants (children, grandchildren, ...), not root itself."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat(int(entry))
            if fields is not None:
                parents[int(entry)] = int(fields[1])
    found: set[int] = set()
    frontier = {root}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier and pid not in found}
        found |= frontier
    return found


def group_members(pgid: int) -> set[int]:
    """Living processes whose process group is pgid."""
    members = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat(int(entry))
            if fields is not None and int(fields[2]) == pgid:
                members.add(int(entry))
    return members


def alive(pids: set[int]) -> set[int]:
    """The pids that still exist and are not zombies."""
    living = set()
    for pid in pids:
        fields = _stat(pid)
        if fields is not None and fields[0] != "Z":
            living.add(pid)
    return living


def mapped_kv_segments(pids: set[int]) -> set[str]:
    """Names of pdserve KV pool segments mapped by any of pids."""
    names: set[str] = set()
    for pid in pids:
        try:
            names |= set(_SHM_PATTERN.findall(Path(f"/proc/{pid}/maps").read_text()))
        except OSError:
            continue
    return names


def existing_segments(names: set[str]) -> set[str]:
    return {name for name in names if Path("/dev/shm", name).exists()}
