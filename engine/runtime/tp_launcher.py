"""Tensor-parallel process group: the leader (rank 0, this process) starts follower ranks that run
every step plan the leader broadcasts (engine/runtime/tp_start.py: forked on the CPU while the leader's process has
one thread, else a fresh interpreter that never re-imports the caller's __main__; a rank that fails to start
raises TPStartError in the leader). Ranks meet on a TCPStore the leader serves. Activations travel on the
default group (gloo on CPU, NCCL / RCCL on GPUs); step plans always travel on a CPU gloo group, so
broadcasting one never touches or synchronises a device. A plan's page tables travel as deltas to each
follower's mirror of them (engine/runtime/page_table_sync.py); a follower whose mirror does not match the
leader's raises PageTableDesync and leaves the group rather than run a step on a wrong table."""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
from datetime import timedelta
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from engine.runtime.devices import rank_device
from engine.runtime.distributed import TPGroup
from engine.runtime.model_runner import ModelRunner, RunnerConfig
from engine.runtime.page_table_sync import PageTableDesync, PageTableReceiver, PageTableSender, from_wire, to_wire
from engine.runtime.step_plan import ShutdownPlan
from engine.runtime.tp_start import TPStartError, follower_failure, start_followers, stop_followers, wait_for_keys
from rpc.processes import child_start_method, die_with_parent, forget_parent_signals

logger = logging.getLogger(__name__)
_COLLECTIVE_TIMEOUT = timedelta(seconds=600)
_FAILURE_GRACE_S = 30.0  # how long a failed leader start looks for the follower failure behind it
__all__ = ["TPLeader", "TPStartError", "activation_backend", "default_threads"]


_STORE_PREFIX = "pdserve-tp/"


def _joined_key(rank: int) -> str:
    return f"{_STORE_PREFIX}joined/{rank}"


def _ready_key(rank: int) -> str:
    return f"{_STORE_PREFIX}ready/{rank}"


def _failed_key(rank: int) -> str:
    return f"{_STORE_PREFIX}failed/{rank}"


def activation_backend(device: str) -> str:
    """The collective backend for activations: nccl (RCCL on ROCm builds) on GPUs, gloo on CPU."""
    return "nccl" if device == "cuda" else "gloo"


def _init_group(rank: int, size: int, store, config: RunnerConfig):
    """Joins the TP group; returns the CPU group step plans travel on (None: the default group is gloo)."""
    if config.device == "cuda":
        torch.cuda.set_device(rank_device(config.device, config.gpus or tuple(range(size)), rank))
    dist.init_process_group(activation_backend(config.device), store=store, rank=rank, world_size=size,
                            timeout=_COLLECTIVE_TIMEOUT)
    return dist.new_group(backend="gloo") if config.device == "cuda" else None


def _master_store(size: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False, timeout=_COLLECTIVE_TIMEOUT)


def _follower_main(rank: int, size: int, port: int | Connection, config: RunnerConfig, log_level: int,
                   forked: bool = False) -> None:
    """A follower's life. port: the leader's TCPStore port, or (forked) the pipe the leader sends it on."""
    if not die_with_parent(signal.SIGKILL):  # a follower is killed when its leader dies, however it dies
        logger.warning("cannot tie follower lifetime to the leader on this platform")
    if os.getppid() == 1:  # the leader already died before the line above ran
        return
    if forked:
        forget_parent_signals()
    role = os.environ.get("PDSERVE_LOG_ROLE", "engine")
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s [{role} rank{rank}] %(name)s: %(message)s",
                        force=forked)  # a forked follower has the leader's handlers: its lines say rank N
    if isinstance(port, Connection):
        try:
            port = port.recv()
        except EOFError:  # the leader gave up before its store was up
            return
    store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=_COLLECTIVE_TIMEOUT)
    try:
        store.set(_joined_key(rank), "1")
        plan_group = _init_group(rank, size, store, config)
        runner = ModelRunner(config, TPGroup(rank, size))
    except BaseException as error:  # tell the leader why, then die with the traceback on stderr
        store.set(_failed_key(rank), f"{type(error).__name__}: {error}")
        raise
    store.set(_ready_key(rank), "1")
    dist.all_gather_object([None] * size, runner.pool_name, group=plan_group)
    tables = PageTableReceiver()
    try:
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0, group=plan_group)
            plan = box[0]
            if isinstance(plan, ShutdownPlan):
                break
            try:
                plan = from_wire(tables, plan)
            except PageTableDesync as error:
                logger.error("rank %d leaves the TP group: %s", rank, error)
                raise
            runner.execute(plan)
    finally:
        runner.close()
        dist.destroy_process_group()


class TPLeader:
    """Rank 0: owns the followers, broadcasts plans, executes its own share. A rank that fails to start raises
    TPStartError here (the leader's own failure too), after every follower is killed and reaped."""

    def __init__(self, config: RunnerConfig, tp_size: int) -> None:
        self.tp_size = tp_size
        self.followers: list = []
        self.plan_group = None
        self.tables = PageTableSender()  # what each follower's page-table mirror holds
        self.runner = None
        self._store = None
        try:
            if tp_size > 1:
                self._start_group(config)
            self.runner = ModelRunner(config, TPGroup(0, tp_size))
            if tp_size > 1:
                wait_for_keys(self._store, self.followers, _ready_key, _failed_key, "loading its shard",
                              _COLLECTIVE_TIMEOUT.total_seconds())
        except BaseException as error:
            failure = self._follower_failure(error)
            self._abandon()
            if failure is not None:
                raise failure from error
            raise
        self.pool_names: tuple[str, ...] = ()
        if tp_size > 1:
            names: list = [None] * tp_size
            dist.all_gather_object(names, self.runner.pool_name, group=self.plan_group)
            if names[0] is not None:
                self.pool_names = tuple(names)
        elif self.runner.pool_name is not None:
            self.pool_names = (self.runner.pool_name,)

    def _start_group(self, config: RunnerConfig) -> None:
        """Starts the followers and meets them on a TCPStore. Forked followers are forked before the store
        exists (its server thread would make this process multi-threaded) and read its port from a pipe."""
        method = child_start_method(config.device)
        level = logging.getLogger().level
        size = self.tp_size
        if method == "fork":
            reader, writer = mp.get_context("fork").Pipe(duplex=False)
            try:
                self.followers = start_followers(_follower_main,
                                                 lambda rank, forked: (rank, size, reader, config, level, True),
                                                 range(1, size), method)
                self._store = _master_store(size)
                for _ in self.followers:
                    writer.send(self._store.port)
            finally:
                reader.close()
                writer.close()
        else:
            self._store = _master_store(size)
            port = self._store.port
            self.followers = start_followers(
                _follower_main, lambda rank, forked: (rank, size, port, config, level, False), range(1, size), method)
        logger.info("started %d TP follower(s) (%s)", size - 1, "fork" if method == "fork" else "exec")
        wait_for_keys(self._store, self.followers, _joined_key, _failed_key, "starting",
                      _COLLECTIVE_TIMEOUT.total_seconds())
        self.plan_group = _init_group(0, size, self._store, config)

    def _follower_failure(self, error: BaseException) -> TPStartError | None:
        """The follower's failure behind the leader's own (e.g. its end of the group's connection closed as the
        follower died loading), so the caller sees the follower's error text rather than gloo's."""
        if isinstance(error, TPStartError) or not isinstance(error, Exception) or self._store is None:
            return None
        return follower_failure(self._store, self.followers, _failed_key, "starting", _FAILURE_GRACE_S)

    def _abandon(self) -> None:
        """After a failed start: kill and reap every follower, leave the group, free the leader's runner."""
        for follower in self.followers:
            follower.kill()
        stop_followers(self.followers, timeout=30)
        self.followers = []
        if dist.is_initialized():
            dist.destroy_process_group()
        if self.runner is not None:
            self.runner.close()
        self._store = None

    def execute(self, plan):
        if self.tp_size > 1:
            wire = to_wire(self.tables, plan)
            try:
                dist.broadcast_object_list([wire], src=0, group=self.plan_group)
            except BaseException:
                self.tables.invalidate()  # it may have reached some followers only: the next plan resyncs
                raise
        return self.runner.execute(plan)

    def close(self) -> None:
        if self.tp_size > 1 and dist.is_initialized():
            try:
                dist.broadcast_object_list([ShutdownPlan()], src=0, group=self.plan_group)
            except RuntimeError as error:  # a follower already left (it failed a step): stop the others anyway
                logger.warning("TP shutdown: %s", str(error).splitlines()[0])
            finally:
                stop_followers(self.followers, timeout=30)
                dist.destroy_process_group()
        self.runner.close()
        self.followers = []
        self._store = None


def default_threads(tp_size: int) -> int:
    return max(1, (os.cpu_count() or 1) // tp_size)
