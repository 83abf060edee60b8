"""training/block_draft.py: the pieces the DFlash and DSpark draft trainers share."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from training.block_draft import (
    DistillText, batch_prompt_lengths, fresh_draft, random_anchors, sample_prompts, weighted_block_loss,
)


def test_anchors_are_sorted_distinct_and_in_range() -> None:
    """Each row holds `count` distinct positions in low..high, ascending."""
    anchors = random_anchors(6, 5, 20, 4, torch.Generator().manual_seed(0))
    assert anchors.shape == (6, 4)
    for row in anchors.tolist():
        assert row == sorted(set(row)) and all(5 <= a <= 20 for a in row)


def test_anchors_respect_a_lower_bound_per_row() -> None:
    """With one low per row, row r's anchors are distinct, ascending and within lows[r]..high."""
    lows = [3, 10, 17, 3]
    anchors = random_anchors(4, lows, 20, 4, torch.Generator().manual_seed(2))
    for low, row in zip(lows, anchors.tolist()):
        assert row == sorted(set(row)) and all(low <= a <= 20 for a in row)
    with pytest.raises(ValueError, match="rows"):
        random_anchors(3, lows, 20, 4, torch.Generator().manual_seed(2))


def test_prompt_lengths_per_generate_batch() -> None:
    """Fixed prompts: every batch gets prompt_length; varied: one length per batch in min..max, seeded."""
    fixed = DistillText(num_sequences=10, prompt_length=7, generated_length=3, generate_batch=4)
    assert batch_prompt_lengths(fixed, seed=0) == [7, 7, 7] and fixed.total_length == 10
    varied = DistillText(num_sequences=400, prompt_length=9, generated_length=3, generate_batch=4, min_prompt_length=2)
    lengths = batch_prompt_lengths(varied, seed=1)
    assert len(lengths) == 100 and set(lengths) == set(range(2, 10))
    assert lengths == batch_prompt_lengths(varied, seed=1) != batch_prompt_lengths(varied, seed=2)
    with pytest.raises(ValueError, match="min_prompt_length"):
        DistillText(num_sequences=4, prompt_length=7, generated_length=3, generate_batch=2, min_prompt_length=8)


def test_block_loss_weights_slot_s_by_exp_minus_s_over_decay() -> None:
    """The loss equals the hand-computed weighted mean of per-slot cross-entropies; accuracy is per slot."""
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 3, 4, 11, generator=generator)
    labels = torch.randint(0, 11, (2, 3, 4), generator=generator)
    loss, accuracy = weighted_block_loss(logits, labels, decay=2.0)
    per_slot = torch.stack([F.cross_entropy(logits[:, :, s].reshape(-1, 11), labels[:, :, s].reshape(-1))
                            for s in range(4)])
    weights = torch.exp(-torch.arange(4.0) / 2.0)
    assert loss.item() == pytest.approx((per_slot * weights).sum().item() / weights.sum().item(), rel=1e-5)
    expected_accuracy = (logits.argmax(-1) == labels).float().mean(dim=(0, 1))
    assert torch.equal(accuracy, expected_accuracy) and accuracy.shape == (4,)


def test_prompts_are_windows_of_the_stream() -> None:
    """sample_prompts: num_sequences windows of prompt_length consecutive stream tokens, the same for a seed."""
    stream = torch.arange(1000)
    text = DistillText(num_sequences=5, prompt_length=7, generated_length=3, generate_batch=2)
    prompts = sample_prompts(stream, text, seed=3)
    assert prompts.shape == (5, 7)
    assert torch.equal(prompts[:, 1:] - prompts[:, :-1], torch.ones(5, 6, dtype=torch.long))
    assert torch.equal(prompts, sample_prompts(stream, text, seed=3))
    with pytest.raises(ValueError, match="generate_batch"):
        DistillText(num_sequences=5, prompt_length=7, generated_length=3, generate_batch=0)


def test_fresh_draft_freezes_the_target_and_draws_linears_from_the_seed() -> None:
    """The target's parameters stop requiring grad; the same seed gives the same draft, in training mode."""
    target = torch.nn.Linear(3, 3)
    first = fresh_draft(lambda: torch.nn.Sequential(torch.nn.Linear(4, 4)), target, seed=5)
    second = fresh_draft(lambda: torch.nn.Sequential(torch.nn.Linear(4, 4)), target, seed=5)
    assert not any(p.requires_grad for p in target.parameters())
    assert first.training and torch.equal(first[0].weight, second[0].weight)
    assert first[0].weight.std().item() < 0.1  # N(0, 0.02), not the default uniform(+-0.5)
