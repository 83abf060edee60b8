"""Process helpers for launchers, pools and shutdown checks, on psutil (no /proc parsing of our own), and the
one place that ties a child's life to its parent (Linux prctl PR_SET_PDEATHSIG)."""
from __future__ import annotations

import ctypes
import functools
import logging
import os
import signal

import psutil

logger = logging.getLogger(__name__)
_PR_SET_PDEATHSIG = 1
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def die_with_parent(sig: int = signal.SIGTERM) -> bool:
    """Asks the kernel to send `sig` to this process when its parent dies (Linux); False where it cannot.
    Safe as a subprocess preexec_fn (no logging, no locks)."""
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig)) == 0
    except (OSError, AttributeError):
        return False


def child_start_method(device: str) -> str:
    """How to start a Python child process that runs engine code: "fork" when this process still has one
    OS thread (native ones counted: OpenMP's, gRPC's) and the child serves the CPU - it inherits the imported
    modules, torch included, instead of importing them again (~2.5 CPU s and ~1 s per child on a small
    machine); otherwise "spawn" (threads' locks and a GPU runtime do not survive a fork)."""
    if device != "cpu":
        return "spawn"
    try:
        return "fork" if len(os.listdir("/proc/self/task")) == 1 else "spawn"
    except OSError:
        return "spawn"


def forget_parent_signals() -> None:
    """In a forked child: drop what the parent's signal set-up left behind (an asyncio wake-up fd, handlers
    that only make sense in the parent), so that signals to the child act on the child."""
    signal.set_wakeup_fd(-1)
    for signum in signal.valid_signals():  # as after exec: Python handlers gone, ignored signals still ignored
        handler = signal.getsignal(signum)
        if callable(handler) and handler is not signal.default_int_handler:
            signal.signal(signum, signal.SIG_DFL)


@functools.cache
def node_id() -> str:
    """This machine's identity for "same node?" questions: the kernel's boot id (hostname as a fallback).
    Read once per process (it changes only with a reboot): every load poll sends it."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as file:
            return file.read().strip()
    except OSError:
        return os.uname().nodename


def start_ticks(pid: int) -> int | None:
    """When a live process started, in clock ticks since boot (with its pid it names one incarnation; the
    value /proc/<pid>/stat field 22 holds, which shm pool headers record); 0 for a process that is gone or a
    zombie; None if it cannot be told (no permission)."""
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return 0
        return round((process.create_time() - psutil.boot_time()) * _CLOCK_TICKS)
    except psutil.NoSuchProcess:
        return 0
    except psutil.AccessDenied:
        return None


def _living(processes: list[psutil.Process]) -> set[int]:
    living = set()
    for process in processes:
        try:
            if process.status() != psutil.STATUS_ZOMBIE:
                living.add(process.pid)
        except psutil.NoSuchProcess:
            continue
    return living


def alive(pids: set[int]) -> set[int]:
    """The pids that still exist and are not zombies."""
    processes = []
    for pid in pids:
        try:
            processes.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            continue
    return _living(processes)


def group_members(pgid: int) -> set[int]:
    """Living (non-zombie) processes whose process group is pgid."""
    members = []
    for process in psutil.process_iter():
        try:
            if os.getpgid(process.pid) == pgid:
                members.append(process)
        except (ProcessLookupError, PermissionError):
            continue
    return _living(members)


def descendants(root: int) -> set[int]:
    """root's living descendants (children, grandchildren, ...), not root itself."""
    try:
        return _living(psutil.Process(root).children(recursive=True))
    except psutil.NoSuchProcess:
        return set()


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads) so far."""
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def tree_cpu_seconds(pid: int) -> float:
    """cpu_seconds of a process and its living descendants (e.g. a worker with its engine process and TP
    followers); a descendant that exits between the two reads is left out."""
    total = cpu_seconds(pid)
    for child in descendants(pid):
        try:
            total += cpu_seconds(child)
        except psutil.NoSuchProcess:
            continue
    return total
