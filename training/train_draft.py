"""Train the DFlash draft on the frozen target's own greedy continuations."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import DeepseekV3ForCausalLM

from engine.models.dflash import DFlashConfig, DFlashDraft

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DraftTraining:
    num_sequences: int = 2048
    prompt_length: int = 32
    generated_length: int = 128
    generate_batch: int = 128
    steps: int = 1500
    batch_size: int = 16
    anchors_per_sequence: int = 16
    lr: float = 2e-3
    min_lr_ratio: float = 0.05
    warmup_steps: int = 20
    weight_decay: float = 0.01
    gamma: float = 4.0  # loss weight of block position i: exp(-(i - 1) / gamma)
    log_every: int = 25


@torch.no_grad()
def greedy_continuations(target: DeepseekV3ForCausalLM, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Batched greedy decoding with a KV cache. prompts: [N, P] -> [N, P + new_tokens] (eos not special)."""
    out = target(prompts, use_cache=True, logits_to_keep=1)
    past, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    pieces = [prompts, token]
    for _ in range(new_tokens - 1):
        out = target(token, past_key_values=past, use_cache=True, logits_to_keep=1)
        past, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        pieces.append(token)
    return torch.cat(pieces, dim=1)


@torch.no_grad()
def capture_hidden(target: DeepseekV3ForCausalLM, tokens: torch.Tensor, layer_ids: tuple[int, ...]) -> torch.Tensor:
    """tokens: [N, T] -> [N, T, len(layer_ids) * hidden]: outputs of decoder layers ``layer_ids``."""
    states = target(tokens, output_hidden_states=True).hidden_states
    return torch.cat([states[i + 1] for i in layer_ids], dim=-1)


def build_dataset(
    target: DeepseekV3ForCausalLM, train_stream: torch.Tensor, cfg: DraftTraining, layer_ids: tuple[int, ...], seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts from the training split, continued greedily by the target.

    Returns tokens [N, T] (int64) and captured hidden states [N, T, C] (bf16)."""
    generator = torch.Generator().manual_seed(seed + 1)
    starts = torch.randint(0, train_stream.numel() - cfg.prompt_length, (cfg.num_sequences,), generator=generator)
    prompts = torch.stack([train_stream[s : s + cfg.prompt_length] for s in starts.tolist()])
    tokens, captured = [], []
    started = time.monotonic()
    for first in range(0, cfg.num_sequences, cfg.generate_batch):
        batch = greedy_continuations(target, prompts[first : first + cfg.generate_batch], cfg.generated_length)
        tokens.append(batch)
        captured.append(capture_hidden(target, batch, layer_ids).to(torch.bfloat16))
        logger.info("draft data: %d/%d sequences, %.0fs", first + batch.shape[0], cfg.num_sequences,
                    time.monotonic() - started)
    return torch.cat(tokens), torch.cat(captured)


def block_loss(
    draft: DFlashDraft, target: DeepseekV3ForCausalLM, tokens: torch.Tensor, captured: torch.Tensor,
    anchors: torch.Tensor, gamma: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted cross-entropy over the masked block positions.

    tokens: [N, T]; captured: [N, T, C]; anchors: [N, K] -> (loss, per-position accuracy [B-1])."""
    b = draft.config.block_size
    offsets = torch.arange(b)
    positions = anchors[..., None] + offsets  # [N, K, B]
    block_tokens = torch.full_like(positions, draft.config.mask_token_id)
    block_tokens[..., 0] = torch.gather(tokens, 1, anchors)
    labels = torch.gather(tokens, 1, positions[..., 1:].flatten(1)).view_as(positions[..., 1:])
    with torch.no_grad():
        embeds = target.get_input_embeddings()(block_tokens)
    hidden = draft.forward_anchors(captured.float(), embeds, anchors)
    logits = target.lm_head(hidden[..., 1:, :]).float()  # [N, K, B-1, V]
    losses = F.cross_entropy(logits.flatten(0, 2), labels.flatten(), reduction="none").view_as(labels)
    weights = torch.exp(-(offsets[1:].float() - 1) / gamma)
    loss = (losses * weights).sum(-1).mean() / weights.sum()
    accuracy = (logits.argmax(-1) == labels).float().mean(dim=(0, 1))
    return loss, accuracy


def train_draft(
    target: DeepseekV3ForCausalLM, draft_config: DFlashConfig, tokens: torch.Tensor, captured: torch.Tensor,
    cfg: DraftTraining, seed: int,
) -> DFlashDraft:
    """Train the draft with the target frozen (its embedding and LM head are shared, not trained)."""
    torch.manual_seed(seed + 2)
    for param in target.parameters():
        param.requires_grad_(False)
    draft = DFlashDraft(draft_config)
    for module in draft.modules():
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.normal_(module.weight, std=0.02)
    draft.train()
    logger.info("draft parameters: %d", sum(p.numel() for p in draft.parameters()))
    optimizer = torch.optim.AdamW(draft.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    generator = torch.Generator().manual_seed(seed + 3)
    n, t = tokens.shape
    low, high = cfg.prompt_length - 1, t - draft_config.block_size  # labels all generated by the target
    started, running = time.monotonic(), 0.0
    for step in range(cfg.steps):
        if step < cfg.warmup_steps:
            lr = cfg.lr * (step + 1) / cfg.warmup_steps
        else:
            progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
            lr = cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
        for group in optimizer.param_groups:
            group["lr"] = lr
        rows = torch.randint(0, n, (cfg.batch_size,), generator=generator)
        anchors = torch.stack([
            torch.randperm(high - low + 1, generator=generator)[: cfg.anchors_per_sequence] + low
            for _ in range(cfg.batch_size)
        ]).sort(dim=1).values
        loss, accuracy = block_loss(draft, target, tokens[rows], captured[rows], anchors, cfg.gamma)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        optimizer.step()
        running += loss.item()
        if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
            logger.info("draft step %d/%d loss %.4f acc@1..%d %s elapsed %.0fs", step + 1, cfg.steps,
                        running / ((step % cfg.log_every) + 1), accuracy.numel(),
                        " ".join(f"{a:.2f}" for a in accuracy.tolist()), time.monotonic() - started)
            running = 0.0
    draft.eval()
    return draft
