"""Train the K3-shaped target (training/k3_net.py) from scratch, float32, on a wall-clock budget.

The learning-rate schedule runs over progress = max(step / max_steps, elapsed / budget), so a run on a
busy machine still finishes on time (with fewer steps, recorded in the metrics). Every checkpoint_minutes
the trainer state goes to work_dir/target_state.pt (resumable) and the model is exported to the output
directory, so a partial run always leaves a loadable checkpoint.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from training.k3_net import K3Net
from training.k3_shape import K3Shape
from training.train_target import sample_windows

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class K3TargetTraining:
    max_steps: int = 100_000
    minutes: float = 40.0
    batch_size: int = 8
    lr: float = 5e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    weight_decay: float = 0.05
    bias_update_rate: float = 1e-3  # aux-loss-free expert balancing
    log_every: int = 10
    checkpoint_minutes: float = 5.0

    def __post_init__(self) -> None:
        if self.max_steps <= 0 or self.minutes <= 0 or self.batch_size <= 0:
            raise ValueError("max_steps, minutes and batch_size must be positive")


def lr_at(step: int, progress: float, cfg: K3TargetTraining) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def make_optimizer(net: K3Net, cfg: K3TargetTraining) -> torch.optim.AdamW:
    decay = [p for n, p in net.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in net.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))


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
    optimizer = make_optimizer(net, cfg)
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
    budget = cfg.minutes * 60

    def checkpoint() -> None:
        work_dir.mkdir(parents=True, exist_ok=True)
        torch.save({"net": net.state_dict(), "optimizer": optimizer.state_dict(), "generator": generator.get_state(),
                    "step": step, "seconds": time.monotonic() - started}, work_dir / "target_state.tmp")
        (work_dir / "target_state.tmp").replace(state_path)
        net.eval()
        export(net)
        net.train()
        logger.info("checkpoint at step %d", step)

    while step < cfg.max_steps:
        elapsed = time.monotonic() - started
        if elapsed >= budget:
            break
        progress = max(step / cfg.max_steps, elapsed / budget)
        lr = lr_at(step, progress, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = sample_windows(stream, cfg.batch_size, shape.train_length, generator)
        logits = net.logits(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        optimizer.step()
        for moe in net.moe_layers():
            moe.balance(cfg.bias_update_rate)
        step += 1
        loss_value = loss.item()
        running, count = running + loss_value, count + 1
        if step % cfg.log_every == 0:
            logger.info("target step %d loss %.4f lr %.2e progress %.3f elapsed %.1f min", step, running / count, lr,
                        progress, (time.monotonic() - started) / 60)
            running, count = 0.0, 0
        if time.monotonic() - last_checkpoint >= cfg.checkpoint_minutes * 60:
            checkpoint()
            last_checkpoint = time.monotonic()
    checkpoint()
    net.eval()
    return net, {"steps": step, "minutes": (time.monotonic() - started) / 60, "final_loss": loss_value}
