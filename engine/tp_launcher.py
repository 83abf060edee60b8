"""Tensor-parallel process group: the leader (rank 0, this process) spawns follower ranks that run
every step plan the leader broadcasts (torch.distributed, gloo on CPU)."""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import socket
from datetime import timedelta

import torch.distributed as dist

from engine.distributed import TPGroup
from engine.model_runner import ModelRunner, RunnerConfig
from engine.step_plan import ShutdownPlan
from rpc.processes import die_with_parent

logger = logging.getLogger(__name__)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _init_group(rank: int, size: int, port: int) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=size,
        timeout=timedelta(seconds=600),
    )


def _follower_main(rank: int, size: int, port: int, config: RunnerConfig, log_level: int) -> None:
    if not die_with_parent(signal.SIGKILL):  # a follower is killed when its leader dies, however it dies
        logger.warning("cannot tie follower lifetime to the leader on this platform")
    if os.getppid() == 1:  # the leader already died before the line above ran
        return
    role = os.environ.get("PDSERVE_LOG_ROLE", "engine")
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s [{role} rank{rank}] %(name)s: %(message)s")
    _init_group(rank, size, port)
    runner = ModelRunner(config, TPGroup(rank, size))
    dist.all_gather_object([None] * size, runner.pool_name)
    try:
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0)
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
        if tp_size > 1:
            port = _free_port()
            context = mp.get_context("spawn")
            for rank in range(1, tp_size):
                process = context.Process(
                    target=_follower_main,
                    args=(rank, tp_size, port, config, logging.getLogger().level),
                    daemon=True,
                    name=f"pdserve-tp-rank{rank}",
                )
                process.start()
                self.followers.append(process)
            _init_group(0, tp_size, port)
        self.runner = ModelRunner(config, TPGroup(0, tp_size))
        self.pool_names: tuple[str, ...] = ()
        if tp_size > 1:
            names: list = [None] * tp_size
            dist.all_gather_object(names, self.runner.pool_name)
            if names[0] is not None:
                self.pool_names = tuple(names)
        elif self.runner.pool_name is not None:
            self.pool_names = (self.runner.pool_name,)

    def execute(self, plan):
        if self.tp_size > 1:
            dist.broadcast_object_list([plan], src=0)
        return self.runner.execute(plan)

    def close(self) -> None:
        if self.tp_size > 1 and dist.is_initialized():
            try:
                dist.broadcast_object_list([ShutdownPlan()], src=0)
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
