"""The prefill worker's batch size policy: a batch holds what the engine prefills in the target time."""
from __future__ import annotations

import pytest

from prefill_worker.batch_policy import PrefillCost, batch_token_limit


def test_limit_is_batch_tokens_until_measured_or_without_a_target():
    """No measurement yet, or target 0: the configured batch_tokens, unchanged."""
    assert batch_token_limit(2048, 100.0, None) == 2048
    assert batch_token_limit(2048, 0.0, 0.5) == 2048


@pytest.mark.parametrize(("ms_per_token", "expected"), [(0.5, 200), (0.01, 2048), (500.0, 1)])
def test_limit_fits_the_target_within_batch_tokens_and_at_least_one(ms_per_token, expected):
    """The tokens that fit target_ms at the measured cost, never above batch_tokens, never below 1."""
    assert batch_token_limit(2048, 100.0, ms_per_token) == expected


def test_cost_follows_recent_batches():
    """The first batch sets the estimate; later ones move it halfway; empty batches are ignored."""
    cost = PrefillCost()
    cost.observe(100.0, 0)
    assert cost.ms_per_token is None
    cost.observe(400.0, 1000)
    assert cost.ms_per_token == pytest.approx(0.4)
    cost.observe(100.0, 1000)
    assert cost.ms_per_token == pytest.approx(0.25)
