"""Process-group helpers of the launcher: children that arm die-with-parent themselves, and killing a whole
group (a worker leader and its TP followers) and waiting until none of it runs (on rpc.processes)."""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import time

from rpc.processes import die_with_parent, group_members

logger = logging.getLogger(__name__)

PARENT_ENV = "PDSERVE_PARENT_PID"  # set by the launcher: the child arms die_with_parent() itself


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
    while group_members(process.pid) and time.monotonic() < deadline:
        time.sleep(0.02)
