"""The optimisation recipe every trainer here shares: AdamW (betas 0.9, 0.95), a linear warmup then a
cosine decay to lr * min_lr_ratio, gradients clipped to norm 1; and the step / wall-clock budget of the
trainers that stop on time (the schedule then runs over progress = max(step / max_steps, elapsed / budget),
so a run on a busy machine still finishes on time, with fewer steps).
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace

import torch

BETAS = (0.9, 0.95)
CLIP_NORM = 1.0


@dataclass(frozen=True)
class Schedule:
    """Learning rate, its warmup and floor, AdamW weight decay, batch size and logging cadence."""

    lr: float
    min_lr_ratio: float
    warmup_steps: int
    weight_decay: float
    batch_size: int
    log_every: int

    def __post_init__(self) -> None:
        if self.lr <= 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"lr must be positive and min_lr_ratio in [0, 1], got {self.lr}, {self.min_lr_ratio}")
        if self.warmup_steps < 0 or self.weight_decay < 0:
            raise ValueError("warmup_steps and weight_decay must be >= 0")
        if self.batch_size <= 0 or self.log_every <= 0:
            raise ValueError("batch_size and log_every must be positive")

    def smoke(self) -> Schedule:
        """The same recipe at toy scale (smoke tests): batch 2, one warmup step, a log line every step."""
        return replace(self, batch_size=2, warmup_steps=1, log_every=1)

    def adamw(self, params: Iterable, fused: bool | None = None) -> torch.optim.AdamW:
        """AdamW at this lr and weight decay (parameter groups may set their own weight_decay)."""
        return torch.optim.AdamW(params, lr=self.lr, betas=BETAS, weight_decay=self.weight_decay, fused=fused)

    def lr_at(self, step: int, progress: float) -> float:
        """Linear warmup over warmup_steps, then cosine from lr to lr * min_lr_ratio as progress goes 0 -> 1."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * cosine)

    def lr_at_step(self, step: int, steps: int) -> float:
        """lr_at for a run of a fixed number of steps: the cosine spans the steps after the warmup."""
        return self.lr_at(step, (step - self.warmup_steps) / max(1, steps - self.warmup_steps))


@dataclass(frozen=True)
class Budget:
    """Stop after max_steps or after minutes of wall-clock time, whichever comes first."""

    max_steps: int
    minutes: float

    def __post_init__(self) -> None:
        if self.max_steps <= 0 or self.minutes <= 0:
            raise ValueError(f"max_steps and minutes must be positive, got {self.max_steps}, {self.minutes}")

    def override(self, max_steps: int | None, minutes: float | None) -> Budget:
        """This budget with the limits given on a command line (None keeps the default)."""
        return replace(self, max_steps=max_steps or self.max_steps, minutes=minutes or self.minutes)

    def progress(self, step: int, elapsed_s: float) -> float:
        return max(step / self.max_steps, elapsed_s / (self.minutes * 60))

    def spent(self, step: int, elapsed_s: float) -> bool:
        return step >= self.max_steps or elapsed_s >= self.minutes * 60


def decay_groups(module: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW parameter groups: matrices decay, embeddings, norms and biases do not."""
    named = list(module.named_parameters())
    decay = [p for n, p in named if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in named if not (p.ndim >= 2 and "embed" not in n)]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def optimizer_step(optimizer: torch.optim.Optimizer, loss: torch.Tensor, parameters: Iterable[torch.Tensor]) -> float:
    """One update: backward, clip, step. Returns the loss as a float."""
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(parameters, CLIP_NORM)
    optimizer.step()
    return loss.item()
