"""Starting TP follower processes and watching them start: forked on the CPU while the leader's process has one
thread (rpc.processes.child_start_method), else a fresh interpreter that runs only our entry point (never
multiprocessing's spawn, which re-imports the caller's __main__: a script without an `if __name__ ==
"__main__":` guard would start its own LLM again in every follower and fail there). A follower that exits or
reports an error before the group is up raises `TPStartError` in the leader at once, with no rank left behind.

Invariants: every process `start_followers` returns is reaped by `stop_followers` (no zombie); a follower never
imports the leader's __main__ module; a start never waits on a follower that is already gone."""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Protocol

logger = logging.getLogger(__name__)

_POLL_S = 0.05  # how often a waiting leader looks at its followers and the store
ENTRY_CODE = "from engine.runtime.tp_start import run_pickled_target; run_pickled_target()"


class TPStartError(RuntimeError):
    """A tensor-parallel rank failed to start (it exited, or raised while joining the group or loading)."""


class Follower(Protocol):
    rank: int

    def exit_code(self) -> int | None: ...

    def kill(self) -> None: ...

    def reap(self, timeout: float) -> None: ...


class _ForkedFollower:
    def __init__(self, rank: int, process: mp.Process) -> None:
        self.rank, self.process = rank, process

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def exit_code(self) -> int | None:
        return self.process.exitcode

    def kill(self) -> None:
        if self.process.exitcode is None:
            self.process.kill()

    def reap(self, timeout: float) -> None:
        self.process.join(timeout)
        if self.process.exitcode is None:
            self.process.kill()
            self.process.join()


class _ExecFollower:
    def __init__(self, rank: int, process: subprocess.Popen) -> None:
        self.rank, self.process = rank, process

    @property
    def pid(self) -> int:
        return self.process.pid

    def exit_code(self) -> int | None:
        return self.process.poll()

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()

    def reap(self, timeout: float) -> None:
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def run_pickled_target() -> None:
    """A fresh follower interpreter's entry point: reads (target, args) pickled on stdin and calls it."""
    target, args = pickle.load(sys.stdin.buffer)
    sys.stdin.close()
    target(*args)


def _child_env() -> dict[str, str]:
    """The leader's environment with its import path, so the child finds the same packages (and our own, also
    when the leader found them through its working directory or a sys.path edit, as in a notebook)."""
    paths = [os.path.abspath(path or os.curdir) for path in sys.path]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}


def start_followers(target: Callable, args_of: Callable[[int, bool], tuple], ranks: Sequence[int],
                    method: str) -> list[Follower]:
    """Starts target(*args_of(rank, forked)) for each rank, forked ("fork") or in a fresh interpreter."""
    followers: list[Follower] = []
    try:
        for rank in ranks:
            if method == "fork":
                process = mp.get_context("fork").Process(target=target, args=args_of(rank, True), daemon=True,
                                                         name=f"pdserve-tp-rank{rank}")
                process.start()
                followers.append(_ForkedFollower(rank, process))
            else:
                payload = pickle.dumps((target, args_of(rank, False)))
                process = subprocess.Popen([sys.executable, "-c", ENTRY_CODE], stdin=subprocess.PIPE,
                                           env=_child_env(), close_fds=True)
                followers.append(_ExecFollower(rank, process))
                try:
                    process.stdin.write(payload)
                    process.stdin.close()
                except BrokenPipeError:  # it died already: wait_for_keys reports it
                    pass
    except BaseException:
        stop_followers(followers, timeout=0)
        raise
    return followers


def stop_followers(followers: Sequence[Follower], timeout: float) -> None:
    """Waits up to `timeout` s for each follower to exit, kills what is left, reaps every one."""
    deadline = time.monotonic() + timeout
    for follower in followers:
        follower.reap(max(0.0, deadline - time.monotonic()))


def _failure_of(store, follower: Follower, error_key_of: Callable[[int], str], what: str) -> TPStartError | None:
    """The follower's start failure, if it reported one (its error text) or exited; else None."""
    if store.check([error_key_of(follower.rank)]):
        message = store.get(error_key_of(follower.rank)).decode(errors="replace")
        return TPStartError(f"TP rank {follower.rank} failed while {what}: {message}")
    code = follower.exit_code()
    if code is None:
        return None
    if store.check([error_key_of(follower.rank)]):  # it reported, then exited, between the two looks
        return _failure_of(store, follower, error_key_of, what)
    return TPStartError(f"TP rank {follower.rank} exited with code {code} while {what} (its stderr says why)")


def wait_for_keys(store, followers: Sequence[Follower], key_of: Callable[[int], str],
                  error_key_of: Callable[[int], str], what: str, timeout_s: float) -> None:
    """Polls until every follower has set key_of(rank) in the store; raises TPStartError as soon as one exits,
    sets error_key_of(rank) (its error text) or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    pending = list(followers)
    while pending:
        for follower in list(pending):
            if store.check([error_key_of(follower.rank)]):
                raise _failure_of(store, follower, error_key_of, what)
            if store.check([key_of(follower.rank)]):
                pending.remove(follower)
                continue
            failure = _failure_of(store, follower, error_key_of, what)
            if failure is not None:
                raise failure
        if pending and time.monotonic() > deadline:
            raise TPStartError(f"TP rank(s) {[f.rank for f in pending]} did not finish {what} in {timeout_s:.0f} s")
        if pending:
            time.sleep(_POLL_S)


def follower_failure(store, followers: Sequence[Follower], error_key_of: Callable[[int], str], what: str,
                     grace_s: float) -> TPStartError | None:
    """After a step of the leader's own start failed (gloo's connectFullMesh: "Connection closed by peer", a
    collective during load): the follower failure behind it, if one reports an error or exits within grace_s
    (it may still be on its way out); None if every follower is alive and silent (the leader's own failure)."""
    deadline = time.monotonic() + grace_s
    while True:
        try:
            for follower in followers:
                failure = _failure_of(store, follower, error_key_of, what)
                if failure is not None:
                    return failure
        except (RuntimeError, OSError):  # the store itself is gone: nothing more to learn
            return None
        if time.monotonic() > deadline:
            return None
        time.sleep(_POLL_S)
