"""Looking at processes and shared memory from outside, for shutdown tests (rpc.processes, on psutil)."""
from __future__ import annotations

import re
from pathlib import Path

import psutil

from rpc.processes import alive, descendants, group_members

__all__ = ["alive", "descendants", "existing_segments", "group_members", "mapped_kv_segments"]
_SHM_PATTERN = re.compile(r"/dev/shm/(pdserve-kv-(?:dev-)?[0-9a-f]+)")


def mapped_kv_segments(pids: set[int]) -> set[str]:
    """Names of pdserve KV pool segments mapped by any of pids."""
    names: set[str] = set()
    for pid in pids:
        try:
            maps = psutil.Process(pid).memory_maps(grouped=True)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        names |= {match.group(1) for region in maps if (match := _SHM_PATTERN.match(region.path))}
    return names


def existing_segments(names: set[str]) -> set[str]:
    return {name for name in names if Path("/dev/shm", name).exists()}
