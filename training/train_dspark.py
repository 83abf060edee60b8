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
import time
from dataclasses import dataclass

import torch

from engine.models.dspark import DSparkDraft
from engine.models.dspark_config import DSparkConfig
from training.block_draft import DistillText, format_accuracy, fresh_draft, random_anchors, weighted_block_loss
from training.k3_net import K3Net
from training.schedule import Budget, Schedule, optimizer_step, set_lr

logger = logging.getLogger(__name__)


DSPARK_SCHEDULE = Schedule(lr=3e-3, min_lr_ratio=0.05, warmup_steps=20, weight_decay=0.01, batch_size=16,
                           log_every=10)


@dataclass(frozen=True)
class DSparkTraining:
    """Updates on anchors_per_sequence blocks of each sequence until the budget is spent; slot k weighs
    exp(-k / decay)."""

    text: DistillText = DistillText(num_sequences=768, prompt_length=32, generated_length=96, generate_batch=64)
    budget: Budget = Budget(max_steps=100_000, minutes=12.0)
    anchors_per_sequence: int = 16
    decay: float = 4.0
    schedule: Schedule = DSPARK_SCHEDULE


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
    return weighted_block_loss(logits, labels, decay)


def train_dspark(
    target: K3Net, config: DSparkConfig, tokens: torch.Tensor, taps: torch.Tensor, cfg: DSparkTraining, seed: int,
    init: DSparkDraft | None = None,
) -> tuple[DSparkDraft, dict]:
    """Trains a draft with the target frozen: a fresh one, or init's weights continued (a second round on new
    text, a fresh schedule); returns it and {steps, minutes, final_loss}."""
    draft = fresh_draft(lambda: DSparkDraft(config), target, seed)
    torch.nn.init.normal_(draft.markov_head.markov_w1.weight, std=0.02)
    torch.nn.init.zeros_(draft.markov_head.markov_w2.weight)
    if init is not None:
        if init.config.to_dict() != config.to_dict():
            raise ValueError("the draft to continue has another configuration than this run's")
        draft.load_state_dict({name: t.float() for name, t in init.state_dict().items()})
    logger.info("draft parameters: %d", sum(p.numel() for p in draft.parameters()))
    schedule = cfg.schedule
    optimizer = schedule.adamw(draft.parameters())
    generator = torch.Generator().manual_seed(seed + 3)
    n, t = tokens.shape
    low, high = cfg.text.prompt_length - 1, t - 1 - config.block_size  # every label is the target's own token
    anchors_per = min(cfg.anchors_per_sequence, high - low + 1)
    started, running, count, step, loss_value = time.monotonic(), 0.0, 0, 0, float("nan")
    while not cfg.budget.spent(step, time.monotonic() - started):
        lr = schedule.lr_at(step, cfg.budget.progress(step, time.monotonic() - started))
        set_lr(optimizer, lr)
        rows = torch.randint(0, n, (schedule.batch_size,), generator=generator)
        anchors = random_anchors(schedule.batch_size, low, high, anchors_per, generator)
        loss, accuracy = dspark_block_loss(draft, target, tokens[rows], taps[rows], anchors, cfg.decay)
        loss_value = optimizer_step(optimizer, loss, draft.parameters())
        step += 1
        running, count = running + loss_value, count + 1
        if step % schedule.log_every == 0:
            logger.info("draft step %d loss %.4f acc by slot %s lr %.2e elapsed %.1f min", step, running / count,
                        format_accuracy(accuracy), lr, (time.monotonic() - started) / 60)
            running, count = 0.0, 0
    draft.eval()
    return draft, {"steps": step, "minutes": (time.monotonic() - started) / 60, "final_loss": loss_value}
