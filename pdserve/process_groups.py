"""Process-group helpers of the launcher: children that die with their parent, and killing a whole
group (a worker leader and its TP followers) and waiting until none of it runs."""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import time

logger = logging.getLogger(__name__)
_PR_SET_PDEATHSIG = 1


PARENT_ENV = "PDSERVE_PARENT_PID"  # set by the launcher: the child arms die_with_parent() itself


def die_with_parent() -> None:
    """The calling process gets SIGTERM when its parent dies (Linux), so nothing is orphaned."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def die_with_parent_if_asked() -> None:
    """Called first thing by `pdserve` commands: when the launcher asked (PARENT_ENV), arm
    die_with_parent() here, in the child (a preexec_fn would run between fork and exec of a process
    full of gRPC and torch threads, which can crash the child), and exit if the parent is already gone."""
    parent = os.environ.pop(PARENT_ENV, "")
    if parent:
        die_with_parent()
        if os.getppid() != int(parent):
            os._exit(1)


def kill_group(process: subprocess.Popen[bytes], role: str, timeout_s: float = 10.0) -> None:
    """SIGKILL to the process's group (the leader's pid is its group id), then wait until no member is
    left running (killing is asynchronous; orphaned followers are reaped by init)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        logger.error("%s (pid %d) survived SIGKILL", role, process.pid)
    deadline = time.monotonic() + timeout_s
    while running_members(process.pid) and time.monotonic() < deadline:
        time.sleep(0.02)


def running_members(pgid: int) -> list[int]:
    """Pids of the group's processes that are not zombies (Linux /proc; empty elsewhere)."""
    members = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return members
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry))
    return members
