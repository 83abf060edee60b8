"""Train the K3-shaped target (training/k3_net.py) from scratch, float32, on a wall-clock budget.

The learning-rate schedule runs over progress = max(step / max_steps, elapsed / budget), so a run on a
busy machine still finishes on time (with fewer steps, recorded in the metrics). Every checkpoint_minutes
the trainer state goes to work_dir/target_state.pt (resumable) and the model is exported to the output
directory, so a partial run always leaves a loadable checkpoint.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from training.k3_net import K3Net
from training.k3_shape import K3Shape
from training.schedule import Budget, Schedule, decay_groups, optimizer_step, set_lr
from training.train_target import next_token_loss, sample_windows

logger = logging.getLogger(__name__)


K3_TARGET_SCHEDULE = Schedule(lr=5e-3, min_lr_ratio=0.1, warmup_steps=30, weight_decay=0.05, batch_size=8,
                              log_every=10)


@dataclass(frozen=True)
class K3TargetTraining:
    """Updates until the budget is spent, a checkpoint every checkpoint_minutes; bias_update_rate: aux-loss-free
    expert balancing."""

    budget: Budget = Budget(max_steps=100_000, minutes=40.0)
    bias_update_rate: float = 1e-3
    checkpoint_minutes: float = 5.0
    schedule: Schedule = K3_TARGET_SCHEDULE

    def __post_init__(self) -> None:
        if self.checkpoint_minutes <= 0:
            raise ValueError(f"checkpoint_minutes must be positive, got {self.checkpoint_minutes}")


def train_k3_target(
    shape: K3Shape, stream: torch.Tensor, cfg: K3TargetTraining, seed: int, work_dir: Path,
    export: Callable[[K3Net], None], init: Callable[[K3Net], object] | None = None,
) -> tuple[K3Net, dict]:
    """Trains (resuming from work_dir/target_state.pt when present; else init(net) first, e.g. a warm start);
    export(net) is called at every checkpoint and at the end. Returns the net and {steps, minutes, final_loss}."""
    torch.manual_seed(seed)
    net = K3Net(shape)
    state_path = work_dir / "target_state.pt"
    if init is not None and not state_path.exists():
        init(net)
    schedule = cfg.schedule
    optimizer = schedule.adamw(decay_groups(net, schedule.weight_decay))
    generator = torch.Generator().manual_seed(seed)
    step, spent = 0, 0.0
    if state_path.exists():
        saved = torch.load(state_path, weights_only=False)
        net.load_state_dict(saved["net"])
        optimizer.load_state_dict(saved["optimizer"])
        generator.set_state(saved["generator"])
        step, spent = saved["step"], saved["seconds"]
        logger.info("resumed at step %d (%.1f min spent)", step, spent / 60)
    net.train()
    logger.info("target parameters: %d", sum(p.numel() for p in net.parameters()))
    started = time.monotonic() - spent
    last_checkpoint, running, count, loss_value = time.monotonic(), 0.0, 0, float("nan")

    def checkpoint() -> None:
        work_dir.mkdir(parents=True, exist_ok=True)
        torch.save({"net": net.state_dict(), "optimizer": optimizer.state_dict(), "generator": generator.get_state(),
                    "step": step, "seconds": time.monotonic() - started}, work_dir / "target_state.tmp")
        (work_dir / "target_state.tmp").replace(state_path)
        net.eval()
        export(net)
        net.train()
        logger.info("checkpoint at step %d", step)

    while not cfg.budget.spent(step, elapsed := time.monotonic() - started):
        progress = cfg.budget.progress(step, elapsed)
        lr = schedule.lr_at(step, progress)
        set_lr(optimizer, lr)
        batch = sample_windows(stream, schedule.batch_size, shape.train_length, generator)
        loss_value = optimizer_step(optimizer, next_token_loss(net.logits(batch[:, :-1]), batch), net.parameters())
        for moe in net.moe_layers():
            moe.balance(cfg.bias_update_rate)
        step += 1
        running, count = running + loss_value, count + 1
        if step % schedule.log_every == 0:
            logger.info("target step %d loss %.4f lr %.2e progress %.3f elapsed %.1f min", step, running / count, lr,
                        progress, (time.monotonic() - started) / 60)
            running, count = 0.0, 0
        if time.monotonic() - last_checkpoint >= cfg.checkpoint_minutes * 60:
            checkpoint()
            last_checkpoint = time.monotonic()
    checkpoint()
    net.eval()
    return net, {"steps": step, "minutes": (time.monotonic() - started) / 60, "final_loss": loss_value}
