"""What the two block-draft trainers (DFlash in train_draft.py, DSpark in train_dspark.py) share: the plan of
the self-distillation text (prompts from the training split, continued greedily by the target), the
random anchors a batch trains on, the position-weighted block loss, and the draft's fresh initialisation.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.nn.functional as F

DraftT = TypeVar("DraftT", bound=torch.nn.Module)


@dataclass(frozen=True)
class DistillText:
    """num_sequences prompts of prompt_length tokens, each continued by the target for generated_length
    tokens, generate_batch sequences at a time. min_prompt_length (None: every prompt is prompt_length long):
    each generate batch draws its prompt length from min_prompt_length..prompt_length and is continued to the
    same total, prompt_length + generated_length tokens, so the draft sees continuations at varied positions."""

    num_sequences: int
    prompt_length: int
    generated_length: int
    generate_batch: int
    min_prompt_length: int | None = None

    def __post_init__(self) -> None:
        for name in ("num_sequences", "prompt_length", "generated_length", "generate_batch"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.min_prompt_length is not None and not 0 < self.min_prompt_length <= self.prompt_length:
            raise ValueError(f"min_prompt_length must be in 1..prompt_length ({self.prompt_length}), "
                             f"got {self.min_prompt_length}")

    @property
    def total_length(self) -> int:
        return self.prompt_length + self.generated_length


def sample_prompts(stream: torch.Tensor, text: DistillText, seed: int) -> torch.Tensor:
    """Random windows of the 1-D token stream: [num_sequences, prompt_length] (the generator is seed + 1)."""
    generator = torch.Generator().manual_seed(seed + 1)
    starts = torch.randint(0, stream.numel() - text.prompt_length, (text.num_sequences,), generator=generator)
    return torch.stack([stream[s : s + text.prompt_length] for s in starts.tolist()])


def batch_prompt_lengths(text: DistillText, seed: int) -> list[int]:
    """The prompt length of each generate batch (the generator is seed + 4): all prompt_length, or drawn
    uniformly from min_prompt_length..prompt_length."""
    batches = -(-text.num_sequences // text.generate_batch)
    if text.min_prompt_length is None:
        return [text.prompt_length] * batches
    generator = torch.Generator().manual_seed(seed + 4)
    return torch.randint(text.min_prompt_length, text.prompt_length + 1, (batches,), generator=generator).tolist()


def random_anchors(
    batch_size: int, low: int | Sequence[int], high: int, count: int, generator: torch.Generator
) -> torch.Tensor:
    """[batch_size, count] sorted anchor positions, each row distinct positions drawn from low..high (low: one
    bound for all rows, or one per row)."""
    lows = [low] * batch_size if isinstance(low, int) else list(low)
    if len(lows) != batch_size:
        raise ValueError(f"low has {len(lows)} rows, batch_size is {batch_size}")
    return torch.stack([
        torch.randperm(high - row_low + 1, generator=generator)[:count] + row_low for row_low in lows
    ]).sort(dim=1).values


def weighted_block_loss(logits: torch.Tensor, labels: torch.Tensor, decay: float) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, K, S, V], labels [N, K, S] -> (cross-entropy with slot s weighted exp(-s / decay), normalised
    by the weights; accuracy per slot [S])."""
    losses = F.cross_entropy(logits.flatten(0, 2), labels.flatten(), reduction="none").view_as(labels)
    weights = torch.exp(-torch.arange(labels.shape[-1]).float() / decay)
    loss = (losses * weights).sum(-1).mean() / weights.sum()
    accuracy = (logits.argmax(-1) == labels).float().mean(dim=(0, 1))
    return loss, accuracy


def fresh_draft(build: Callable[[], DraftT], target: torch.nn.Module, seed: int) -> DraftT:
    """Freezes the target (its embedding and LM head are shared, not trained) and builds the draft under
    torch seed seed + 2 with every Linear weight drawn from N(0, 0.02); returns it in training mode."""
    torch.manual_seed(seed + 2)
    for param in target.parameters():
        param.requires_grad_(False)
    draft = build()
    for module in draft.modules():
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.normal_(module.weight, std=0.02)
    draft.train()
    return draft


def format_accuracy(accuracy: torch.Tensor) -> str:
    return " ".join(f"{a:.2f}" for a in accuracy.tolist())
