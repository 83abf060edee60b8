"""Tensor-parallel process group: the leader (rank 0, this process) starts follower ranks that run
every step plan the leader broadcasts (forked on the CPU while the leader's process has one thread, else
spawned: rpc.processes.child_start_method). Activations travel on the default group (gloo on CPU, NCCL /
RCCL on GPUs); step plans always travel on a CPU gloo group, so broadcasting one never touches or
synchronises a device."""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.devices import rank_device
from engine.distributed import TPGroup
from engine.model_runner import ModelRunner, RunnerConfig
from engine.step_plan import ShutdownPlan
from rpc.processes import child_start_method, die_with_parent, forget_parent_signals

logger = logging.getLogger(__name__)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def activation_backend(device: str) -> str:
    """The collective backend for activations: nccl (RCCL on ROCm builds) on GPUs, gloo on CPU."""
    return "nccl" if device == "cuda" else "gloo"


def _init_group(rank: int, size: int, port: int, config: RunnerConfig):
    """Joins the TP group; returns the CPU group step plans travel on (None: the default group is gloo)."""
    if config.device == "cuda":
        torch.cuda.set_device(rank_device(config.device, config.gpus or tuple(range(size)), rank))
    dist.init_process_group(
        activation_backend(config.device),
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=size,
        timeout=timedelta(seconds=600),
    )
    return dist.new_group(backend="gloo") if config.device == "cuda" else None


def _follower_main(rank: int, size: int, port: int, config: RunnerConfig, log_level: int, forked: bool = False) -> None:
    if not die_with_parent(signal.SIGKILL):  # a follower is killed when its leader dies, however it dies
        logger.warning("cannot tie follower lifetime to the leader on this platform")
    if os.getppid() == 1:  # the leader already died before the line above ran
        return
    if forked:
        forget_parent_signals()
    role = os.environ.get("PDSERVE_LOG_ROLE", "engine")
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s [{role} rank{rank}] %(name)s: %(message)s",
                        force=forked)  # a forked follower has the leader's handlers: its lines say rank N
    plan_group = _init_group(rank, size, port, config)
    runner = ModelRunner(config, TPGroup(rank, size))
    dist.all_gather_object([None] * size, runner.pool_name, group=plan_group)
    try:
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0, group=plan_group)
            plan = box[0]
            if isinstance(plan, ShutdownPlan):
                break
            runner.execute(plan)
    finally:
        runner.close()
        dist.destroy_process_group()


class TPLeader:
    """Rank 0: owns the followers, broadcasts plans, executes its own share."""

    def __init__(self, config: RunnerConfig, tp_size: int) -> None:
        self.tp_size = tp_size
        self.followers: list[mp.Process] = []
        self.plan_group = None
        if tp_size > 1:
            port = _free_port()
            method = child_start_method(config.device)
            context = mp.get_context(method)
            for rank in range(1, tp_size):
                process = context.Process(
                    target=_follower_main,
                    args=(rank, tp_size, port, config, logging.getLogger().level, method == "fork"),
                    daemon=True,
                    name=f"pdserve-tp-rank{rank}",
                )
                process.start()
                self.followers.append(process)
            logger.info("started %d TP follower(s) (%s)", tp_size - 1, method)
            self.plan_group = _init_group(0, tp_size, port, config)
        self.runner = ModelRunner(config, TPGroup(0, tp_size))
        self.pool_names: tuple[str, ...] = ()
        if tp_size > 1:
            names: list = [None] * tp_size
            dist.all_gather_object(names, self.runner.pool_name, group=self.plan_group)
            if names[0] is not None:
                self.pool_names = tuple(names)
        elif self.runner.pool_name is not None:
            self.pool_names = (self.runner.pool_name,)

    def execute(self, plan):
        if self.tp_size > 1:
            dist.broadcast_object_list([plan], src=0, group=self.plan_group)
        return self.runner.execute(plan)

    def close(self) -> None:
        if self.tp_size > 1 and dist.is_initialized():
            try:
                dist.broadcast_object_list([ShutdownPlan()], src=0, group=self.plan_group)
            finally:
                for process in self.followers:
                    process.join(timeout=30)
                    if process.is_alive():
                        process.kill()
                dist.destroy_process_group()
        self.runner.close()
        self.followers.clear()


def default_threads(tp_size: int) -> int:
    return max(1, (os.cpu_count() or 1) // tp_size)
