"""Train the DSpark draft (engine/models/dspark.py) of the K3-shaped target on the target's own greedy text.

Data: prompts from the training split, continued greedily by the SAVED target through the engine; the
target's taps (K3Net, the same function as the engine's capture) over every position.
Loss (K3_SPEC 5.3, teacher forced): block [token at anchor L, MASK x (gamma-1)] at positions L..L+gamma-1
sees the taps of positions < L; slot k predicts the token at L+k+1 with logits
lm_head(h_k) + markov_head(token at L+k) (the vanilla head); cross-entropy weighted exp(-k / decay) (DFlash recipe).
The target (embedding, LM head) stays frozen; a wall-clock budget bounds the run like the target's.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.models.dspark import DSparkDraft
from engine.models.dspark_config import DSparkConfig
from training.k3_net import K3Net

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DSparkTraining:
    num_sequences: int = 768
    prompt_length: int = 32
    generated_length: int = 96
    generate_batch: int = 64
    max_steps: int = 100_000
    minutes: float = 12.0
    batch_size: int = 16
    anchors_per_sequence: int = 16
    lr: float = 3e-3
    min_lr_ratio: float = 0.05
    warmup_steps: int = 20
    weight_decay: float = 0.01
    decay: float = 4.0  # loss weight of slot k: exp(-k / decay)
    log_every: int = 10

    def __post_init__(self) -> None:
        if self.num_sequences <= 0 or self.generated_length <= 0 or self.minutes <= 0:
            raise ValueError("num_sequences, generated_length and minutes must be positive")


@torch.no_grad()
def capture_taps(target: K3Net, tokens: torch.Tensor, layer_ids: tuple[int, ...], batch: int = 32) -> torch.Tensor:
    """tokens [N, T] -> the concatenated taps [N, T, len(layer_ids) * hidden] (float32)."""
    pieces = []
    for first in range(0, tokens.shape[0], batch):
        _, taps = target(tokens[first : first + batch], layer_ids)
        pieces.append(torch.cat(taps, dim=-1))
    return torch.cat(pieces)


def dspark_block_loss(
    draft: DSparkDraft, target: K3Net, tokens: torch.Tensor, taps: torch.Tensor, anchors: torch.Tensor, decay: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [N, T], taps [N, T, C], anchors [N, K] -> (loss, accuracy per slot [gamma])."""
    gamma = draft.config.block_size
    offsets = torch.arange(gamma)
    positions = anchors[..., None] + offsets  # [N, K, gamma]: slot k sits at L+k
    flat = positions.flatten(1)
    previous = torch.gather(tokens, 1, flat).view_as(positions)  # token at L+k (prev of slot k)
    labels = torch.gather(tokens, 1, flat + 1).view_as(positions)  # token at L+k+1
    block = torch.full_like(positions, draft.config.mask_token_id)
    block[..., 0] = previous[..., 0]
    with torch.no_grad():
        embeds = target.model.embed_tokens(block)
    hidden = draft.forward_anchors(taps, embeds, anchors)
    logits = target.lm_head(hidden) + draft.markov_head(previous.flatten()).view(*previous.shape, -1)
    losses = F.cross_entropy(logits.flatten(0, 2), labels.flatten(), reduction="none").view_as(labels)
    weights = torch.exp(-offsets.float() / decay)
    loss = (losses * weights).sum(-1).mean() / weights.sum()
    accuracy = (logits.argmax(-1) == labels).float().mean(dim=(0, 1))
    return loss, accuracy


def train_dspark(
    target: K3Net, config: DSparkConfig, tokens: torch.Tensor, taps: torch.Tensor, cfg: DSparkTraining, seed: int,
) -> tuple[DSparkDraft, dict]:
    """Trains a fresh draft with the target frozen; returns it and {steps, minutes, final_loss}."""
    torch.manual_seed(seed + 2)
    for param in target.parameters():
        param.requires_grad_(False)
    draft = DSparkDraft(config)
    for module in draft.modules():
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.normal_(module.weight, std=0.02)
    torch.nn.init.normal_(draft.markov_head.markov_w1.weight, std=0.02)
    torch.nn.init.zeros_(draft.markov_head.markov_w2.weight)
    draft.train()
    logger.info("draft parameters: %d", sum(p.numel() for p in draft.parameters()))
    optimizer = torch.optim.AdamW(draft.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    generator = torch.Generator().manual_seed(seed + 3)
    n, t = tokens.shape
    low, high = cfg.prompt_length - 1, t - 1 - config.block_size  # every label is the target's own token
    anchors_per = min(cfg.anchors_per_sequence, high - low + 1)
    started, running, count, step, loss_value = time.monotonic(), 0.0, 0, 0, float("nan")
    budget = cfg.minutes * 60
    while step < cfg.max_steps and time.monotonic() - started < budget:
        progress = max(step / cfg.max_steps, (time.monotonic() - started) / budget)
        if step < cfg.warmup_steps:
            lr = cfg.lr * (step + 1) / cfg.warmup_steps
        else:
            lr = cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))
        for group in optimizer.param_groups:
            group["lr"] = lr
        rows = torch.randint(0, n, (cfg.batch_size,), generator=generator)
        anchors = torch.stack([torch.randperm(high - low + 1, generator=generator)[:anchors_per] + low
                               for _ in range(cfg.batch_size)]).sort(dim=1).values
        loss, accuracy = dspark_block_loss(draft, target, tokens[rows], taps[rows], anchors, cfg.decay)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        optimizer.step()
        step += 1
        loss_value = loss.item()
        running, count = running + loss_value, count + 1
        if step % cfg.log_every == 0:
            logger.info("draft step %d loss %.4f acc by slot %s lr %.2e elapsed %.1f min", step, running / count,
                        " ".join(f"{a:.2f}" for a in accuracy.tolist()), lr, (time.monotonic() - started) / 60)
            running, count = 0.0, 0
    draft.eval()
    return draft, {"steps": step, "minutes": (time.monotonic() - started) / 60, "final_loss": loss_value}
