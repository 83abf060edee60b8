"""training/schedule.py: the warmup-cosine learning rate, the step / wall-clock budget and the update step
that every trainer shares."""
from __future__ import annotations

import math

import pytest
import torch

from training.schedule import Budget, Schedule, decay_groups, optimizer_step

SCHEDULE = Schedule(lr=1e-2, min_lr_ratio=0.1, warmup_steps=4, weight_decay=0.05, batch_size=8, log_every=10)


def test_warmup_rises_linearly_then_cosine_falls_to_the_floor() -> None:
    """Warmup step i gives lr (i + 1) / warmup; after it the cosine starts at lr and ends at lr * min_lr_ratio."""
    assert [SCHEDULE.lr_at(i, 0.0) for i in range(4)] == pytest.approx([2.5e-3, 5e-3, 7.5e-3, 1e-2])
    assert SCHEDULE.lr_at(4, 0.0) == pytest.approx(1e-2)
    assert SCHEDULE.lr_at(4, 0.5) == pytest.approx(1e-2 * (0.1 + 0.9 * 0.5))
    assert SCHEDULE.lr_at(4, 1.0) == pytest.approx(1e-3)
    assert SCHEDULE.lr_at(4, 7.0) == SCHEDULE.lr_at(4, 1.0)  # progress past the end stays at the floor


def test_fixed_step_runs_span_the_cosine_over_the_steps_after_warmup() -> None:
    """lr_at_step: step warmup is progress 0, the last of `steps` steps is just short of the floor."""
    steps = 24
    assert SCHEDULE.lr_at_step(4, steps) == pytest.approx(SCHEDULE.lr)
    last = SCHEDULE.lr_at_step(steps - 1, steps)
    assert last == pytest.approx(SCHEDULE.lr_at(steps - 1, 19 / 20))
    assert SCHEDULE.lr * SCHEDULE.min_lr_ratio < last < SCHEDULE.lr_at_step(steps - 2, steps)


def test_smoke_keeps_the_recipe_and_shrinks_the_run() -> None:
    """smoke(): batch 2, one warmup step, a log line every step; lr, floor and weight decay unchanged."""
    smoke = SCHEDULE.smoke()
    assert (smoke.batch_size, smoke.warmup_steps, smoke.log_every) == (2, 1, 1)
    assert (smoke.lr, smoke.min_lr_ratio, smoke.weight_decay) == (SCHEDULE.lr, SCHEDULE.min_lr_ratio, 0.05)


@pytest.mark.parametrize("field, value", [("lr", 0.0), ("min_lr_ratio", 1.5), ("warmup_steps", -1),
                                          ("batch_size", 0), ("log_every", 0)])
def test_bad_schedule_is_refused(field: str, value: float) -> None:
    """Each invalid field raises a ValueError that names it."""
    fields = {"lr": 1e-3, "min_lr_ratio": 0.1, "warmup_steps": 1, "weight_decay": 0.0, "batch_size": 1, "log_every": 1}
    with pytest.raises(ValueError, match=field):
        Schedule(**{**fields, field: value})


def test_budget_stops_on_steps_or_time_and_reports_the_larger_progress() -> None:
    """spent() at max_steps or minutes * 60 seconds; progress is the larger of the two fractions."""
    budget = Budget(max_steps=100, minutes=2.0)
    assert not budget.spent(99, 119.9)
    assert budget.spent(100, 0.0) and budget.spent(0, 120.0)
    assert budget.progress(10, 60.0) == pytest.approx(0.5)
    assert budget.progress(80, 60.0) == pytest.approx(0.8)
    assert budget.override(None, None) == budget
    assert budget.override(7, 0.5) == Budget(max_steps=7, minutes=0.5)
    with pytest.raises(ValueError, match="max_steps"):
        Budget(max_steps=0, minutes=1.0)


def test_decay_groups_exempt_embeddings_norms_and_biases() -> None:
    """Matrices decay; embeddings and 1-D parameters (norm weights, biases) get weight_decay 0."""
    model = torch.nn.ModuleDict({"embed_tokens": torch.nn.Embedding(8, 4), "proj": torch.nn.Linear(4, 4),
                                 "norm": torch.nn.LayerNorm(4)})
    decay, no_decay = decay_groups(model, 0.05)
    assert decay["weight_decay"] == 0.05 and no_decay["weight_decay"] == 0.0
    assert [p is model["proj"].weight for p in decay["params"]] == [True]
    assert len(no_decay["params"]) == 4  # embedding, proj bias, norm weight and bias


def test_optimizer_step_clips_the_gradient_to_norm_one() -> None:
    """A loss with a gradient of norm 100 moves SGD(lr=1) parameters by a vector of norm 1."""
    weight = torch.nn.Parameter(torch.zeros(4))
    optimizer = torch.optim.SGD([weight], lr=1.0)
    value = optimizer_step(optimizer, (weight * torch.tensor([50.0, 50.0, 50.0, 50.0])).sum(), [weight])
    assert value == 0.0
    assert weight.detach().norm().item() == pytest.approx(1.0, rel=1e-5)
    assert math.isclose(weight[0].item(), -0.5, rel_tol=1e-5)
