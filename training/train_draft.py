"""Train the DFlash draft on the frozen target's own greedy continuations."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from transformers import DeepseekV3ForCausalLM

from engine import LLM
from engine.models.dflash import DFlashConfig, DFlashDraft, load_draft, read_draft_config
from training.block_draft import (
    DistillText, batch_prompt_lengths, format_accuracy, fresh_draft, random_anchors, sample_prompts,
    weighted_block_loss,
)
from engine.sampling_params import SamplingParams
from training.schedule import Budget, Schedule, optimizer_step, set_lr

logger = logging.getLogger(__name__)


Continue = Callable[[torch.Tensor, int], torch.Tensor]  # (prompts [N, P], new tokens) -> [N, P + new]
DRAFT_SCHEDULE = Schedule(lr=2e-3, min_lr_ratio=0.05, warmup_steps=20, weight_decay=0.01, batch_size=16, log_every=25)


@dataclass(frozen=True)
class DraftTraining:
    """steps updates on anchors_per_sequence blocks of each sequence; block position i + 1 weighs exp(-i / gamma).
    minutes (None: no limit): a wall-clock budget of the update loop; the cosine then runs over Budget's
    progress and the loop stops at whichever of steps / minutes comes first."""

    text: DistillText = DistillText(num_sequences=2048, prompt_length=32, generated_length=128, generate_batch=128)
    steps: int = 1500
    anchors_per_sequence: int = 16
    gamma: float = 4.0
    schedule: Schedule = DRAFT_SCHEDULE
    minutes: float | None = None

    def __post_init__(self) -> None:
        if self.steps <= 0 or self.anchors_per_sequence <= 0 or self.gamma <= 0:
            raise ValueError(f"steps, anchors_per_sequence and gamma must be positive, got {self.steps}, "
                             f"{self.anchors_per_sequence}, {self.gamma}")
        if self.minutes is not None and self.minutes <= 0:
            raise ValueError(f"minutes must be positive, got {self.minutes}")


@torch.no_grad()
def greedy_continuations(target: DeepseekV3ForCausalLM, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Batched greedy decoding with a KV cache. prompts: [N, P] -> [N, P + new_tokens] (eos not special)."""
    out = target(prompts, use_cache=True, logits_to_keep=1)
    past, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    pieces = [prompts, token]
    for _ in range(new_tokens - 1):
        out = target(token, cache=past, use_cache=True, logits_to_keep=1)
        past, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        pieces.append(token)
    return torch.cat(pieces, dim=1)


def engine_continuations(llm: LLM) -> Continue:
    """Greedy continuations by the serving engine (the same tokens the transformers loop gives up to float
    ties, and the ones speculation is verified against; ~15x faster batched on CPU)."""
    def run(prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
        rows = prompts.tolist()
        params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True, speculative=False)
        return torch.tensor([row + out for row, out in zip(rows, llm.generate(rows, params))])
    return run


@torch.no_grad()
def capture_hidden(target: DeepseekV3ForCausalLM, tokens: torch.Tensor, layer_ids: tuple[int, ...]) -> torch.Tensor:
    """tokens: [N, T] -> [N, T, len(layer_ids) * hidden]: outputs of decoder layers ``layer_ids``."""
    states = target(tokens, output_hidden_states=True).hidden_states
    return torch.cat([states[i + 1] for i in layer_ids], dim=-1)


def build_dataset(
    target: DeepseekV3ForCausalLM, train_stream: torch.Tensor, cfg: DraftTraining, layer_ids: tuple[int, ...], seed: int,
    continue_greedily: Continue | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prompts from the training split, continued greedily by the target to text.total_length tokens
    (continue_greedily(prompts, new_tokens); default: greedy_continuations on the transformers target).

    Returns tokens [N, T] (int64), captured hidden states [N, T, C] (bf16) and each row's prompt length [N]."""
    if continue_greedily is None:
        continue_greedily = partial(greedy_continuations, target)
    text = cfg.text
    prompts = sample_prompts(train_stream, text, seed)
    tokens, captured, lengths = [], [], []
    started = time.monotonic()
    for batch_index, length in enumerate(batch_prompt_lengths(text, seed)):
        first = batch_index * text.generate_batch
        window = prompts[first : first + text.generate_batch, text.prompt_length - length :]
        batch = continue_greedily(window, text.total_length - length)
        tokens.append(batch)
        captured.append(capture_hidden(target, batch, layer_ids).to(torch.bfloat16))
        lengths.append(torch.full((batch.shape[0],), length))
        logger.info("draft data: %d/%d sequences (prompt %d), %.0fs", first + batch.shape[0], text.num_sequences,
                    length, time.monotonic() - started)
    return torch.cat(tokens), torch.cat(captured), torch.cat(lengths)


def warm_draft(init_dir: Path, config: DFlashConfig, target: DeepseekV3ForCausalLM) -> DFlashDraft:
    """The draft saved in init_dir (its config must equal config), in training mode, with the target frozen."""
    saved = read_draft_config(init_dir)
    if saved != config:
        raise ValueError(f"--draft-init {init_dir}: its config {saved} differs from this run's {config}")
    for param in target.parameters():
        param.requires_grad_(False)
    return load_draft(init_dir).train()


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
    return weighted_block_loss(logits, labels, gamma)


def train_draft(
    target: DeepseekV3ForCausalLM, draft_config: DFlashConfig, data: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    cfg: DraftTraining, seed: int, init_dir: Path | None = None,
) -> tuple[DFlashDraft, int]:
    """Train the draft with the target frozen (its embedding and LM head are shared, not trained) on
    build_dataset's (tokens, captured, prompt lengths); init_dir: warm-start from that draft directory.
    Returns the draft (eval mode) and the number of updates made (cfg.steps unless cfg.minutes ran out)."""
    if init_dir is None:
        draft = fresh_draft(lambda: DFlashDraft(draft_config), target, seed)
    else:
        draft = warm_draft(init_dir, draft_config, target)
    tokens, captured, prompt_lengths = data
    logger.info("draft parameters: %d", sum(p.numel() for p in draft.parameters()))
    schedule = cfg.schedule
    optimizer = schedule.adamw(draft.parameters())
    generator = torch.Generator().manual_seed(seed + 3)
    n, t = tokens.shape
    lows, high = prompt_lengths - 1, t - draft_config.block_size  # labels all generated by the target
    budget = None if cfg.minutes is None else Budget(cfg.steps, cfg.minutes)
    started, running, step = time.monotonic(), 0.0, 0
    while step < cfg.steps:
        if budget is None:
            lr = schedule.lr_at_step(step, cfg.steps)
        else:
            elapsed = time.monotonic() - started
            if budget.spent(step, elapsed):
                break
            lr = schedule.lr_at(step, budget.progress(step, elapsed))
        set_lr(optimizer, lr)
        rows = torch.randint(0, n, (schedule.batch_size,), generator=generator)
        anchors = random_anchors(schedule.batch_size, lows[rows].tolist(), high, cfg.anchors_per_sequence, generator)
        loss, accuracy = block_loss(draft, target, tokens[rows], captured[rows], anchors, cfg.gamma)
        running += optimizer_step(optimizer, loss, draft.parameters())
        step += 1
        if step % schedule.log_every == 0 or step == cfg.steps:
            logger.info("draft step %d/%d loss %.4f acc@1..%d %s lr %.2e elapsed %.0fs", step, cfg.steps,
                        running / (((step - 1) % schedule.log_every) + 1), accuracy.numel(),
                        format_accuracy(accuracy), lr, time.monotonic() - started)
            running = 0.0
    logger.info("draft: %d updates in %.0fs", step, time.monotonic() - started)
    draft.eval()
    return draft, step
