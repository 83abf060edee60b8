"""Looking at processes and shared memory from outside, for shutdown tests (rpc.processes, on psutil), and
starting an extra gateway process in front of a deployment's workers."""
from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import psutil

from pdserve.healthcheck import check
from rpc.processes import alive, descendants, group_members
from rpc.server import read_ready_file

__all__ = ["alive", "descendants", "existing_segments", "group_members", "mapped_kv_segments", "serving_gateway"]
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


def serving_gateway(command: list[str], ready: Path, timeout: float = 120.0) -> tuple[subprocess.Popen[bytes], str]:
    """Starts `pdserve gateway` (command: its flags) and waits until it reports SERVING; returns it and its address."""
    process = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "gateway", *command, "--ready-file", str(ready)],
                               start_new_session=True)
    deadline = time.monotonic() + timeout
    try:
        while not ready.exists():
            assert process.poll() is None and time.monotonic() < deadline, "the gateway did not start"
            time.sleep(0.05)
        address = read_ready_file(str(ready))[0]
        while not check(address, timeout=2.0)[0]:
            assert process.poll() is None and time.monotonic() < deadline, "the gateway is not SERVING"
            time.sleep(0.05)
    except BaseException:
        process.kill()
        process.wait()
        raise
    return process, address
