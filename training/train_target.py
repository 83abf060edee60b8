"""Train the DeepSeek-V3-architecture target with transformers' DeepseekV3ForCausalLM."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from training.schedule import Schedule, decay_groups, optimizer_step, set_lr

logger = logging.getLogger(__name__)


TARGET_SCHEDULE = Schedule(lr=4e-3, min_lr_ratio=0.1, warmup_steps=60, weight_decay=0.05, batch_size=8, log_every=100)


@dataclass(frozen=True)
class TargetTraining:
    """steps updates; bias_update_rate: aux-loss-free load balancing (DeepSeek-V3)."""

    steps: int = 2800
    bias_update_rate: float = 1e-3
    schedule: Schedule = TARGET_SCHEDULE


def sample_windows(stream: torch.Tensor, batch_size: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """Random windows of ``length + 1`` tokens from a 1-D token stream: [batch, length + 1]."""
    starts = torch.randint(0, stream.numel() - length - 1, (batch_size,), generator=generator)
    return torch.stack([stream[s : s + length + 1] for s in starts.tolist()])


def next_token_loss(logits: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    """logits [B, L, V] of the windows batch [B, L + 1] without its last token -> mean cross-entropy."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


class ExpertLoadBalancer:
    """Aux-loss-free balancing: nudge each router's e_score_correction_bias towards equal load."""

    def __init__(self, model: DeepseekV3ForCausalLM, rate: float) -> None:
        self.rate = rate
        self.counts: dict[torch.nn.Module, torch.Tensor] = {}
        self.routers = [m for m in model.modules() if type(m).__name__ == "DeepseekV3TopkRouter"]
        for router in self.routers:
            router.register_forward_hook(self._record)

    def _record(self, module: torch.nn.Module, inputs: tuple, output: tuple) -> None:
        if torch.is_grad_enabled():
            indices = output[2]
            self.counts[module] = torch.bincount(indices.flatten(), minlength=module.num_experts).float()

    @torch.no_grad()
    def update(self) -> None:
        for router, load in self.counts.items():
            router.e_score_correction_bias += self.rate * torch.sign(load.mean() - load)
        self.counts.clear()


def train_target(
    config: DeepseekV3Config, train_stream: torch.Tensor, cfg: TargetTraining, seed: int
) -> DeepseekV3ForCausalLM:
    """Train from scratch on random windows of ``train_stream`` (float32, AdamW, cosine)."""
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(config)
    model.train()
    logger.info("target parameters: %d", sum(p.numel() for p in model.parameters()))
    schedule = cfg.schedule
    optimizer = schedule.adamw(decay_groups(model, schedule.weight_decay), fused=True)
    balancer = ExpertLoadBalancer(model, cfg.bias_update_rate)
    generator = torch.Generator().manual_seed(seed)
    length = config.rope_parameters["original_max_position_embeddings"]
    started = time.monotonic()
    running = 0.0
    for step in range(cfg.steps):
        lr = schedule.lr_at_step(step, cfg.steps)
        set_lr(optimizer, lr)
        batch = sample_windows(train_stream, schedule.batch_size, length, generator)
        logits = model(batch[:, :-1], use_cache=False).logits
        running += optimizer_step(optimizer, next_token_loss(logits, batch), model.parameters())
        balancer.update()
        if (step + 1) % schedule.log_every == 0 or step + 1 == cfg.steps:
            logger.info("target step %d/%d loss %.4f lr %.2e elapsed %.0fs", step + 1, cfg.steps,
                        running / ((step % schedule.log_every) + 1), lr, time.monotonic() - started)
            running = 0.0
    model.eval()
    return model
