"""SamplingParams: every invalid field raises ValueError naming that field; valid settings are kept."""
from __future__ import annotations

import dataclasses
import math

import pytest

from engine.sampling_params import SamplingParams

BAD_VALUES = [
    ("max_new_tokens", 0), ("max_new_tokens", -3), ("max_new_tokens", 2.5), ("max_new_tokens", True),
    ("temperature", -0.1), ("temperature", math.nan), ("temperature", math.inf), ("temperature", "1"),
    ("top_k", -2), ("top_k", 3.0), ("top_k", None),
    ("top_p", 0.0), ("top_p", -0.5), ("top_p", 1.01), ("top_p", math.nan),
    ("min_p", -0.01), ("min_p", 1.5), ("min_p", math.nan),
    ("seed", -1), ("seed", 1.5),
    ("stop_token_ids", (1, -2)), ("stop_token_ids", 7), ("stop_token_ids", ("a",)),
    ("ignore_eos", 1),
    ("logprobs", -1), ("logprobs", 21),
    ("speculative", "yes"),
    ("block_size", 1), ("block_size", 0), ("block_size", 4.0),
]


@pytest.mark.parametrize(("field", "value"), BAD_VALUES)
def test_invalid_field_raises_naming_it(field: str, value: object) -> None:
    """Construction with one bad field fails with a ValueError whose message names the field."""
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_valid_settings_are_kept() -> None:
    """Boundary values are accepted, stop ids become a tuple, greedy follows temperature 0."""
    params = SamplingParams(max_new_tokens=1, temperature=0, top_k=0, top_p=1.0, min_p=1.0, seed=0,
                            stop_token_ids=[3, 4], logprobs=20, speculative=False, block_size=2)
    assert params.stop_token_ids == (3, 4)
    assert params.greedy and not SamplingParams(temperature=0.5).greedy
    assert SamplingParams(top_k=-1, min_p=0.0, top_p=1e-6).top_p == 1e-6


def test_params_are_frozen() -> None:
    """A SamplingParams cannot be changed after validation."""
    with pytest.raises(dataclasses.FrozenInstanceError):
        SamplingParams().temperature = 2.0  # type: ignore[misc]
