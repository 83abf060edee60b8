"""training/evaluate_draft.py: the draft comparison's command line."""
from __future__ import annotations

from pathlib import Path

import pytest

from training.evaluate_draft import parse_args


def test_defaults_are_the_benchmark_shape_and_bad_counts_are_refused() -> None:
    """Defaults: 24 held-out prompts of 64 tokens, 128 new tokens, block 8; a non-positive count exits with an
    error naming the option."""
    args = parse_args(["--drafts", "a", "b"])
    assert args.drafts == [Path("a"), Path("b")]
    assert (args.prompt_length, args.new_tokens, args.prompts, args.block_size) == (64, 128, 24, 8)
    with pytest.raises(SystemExit):
        parse_args(["--drafts", "a", "--prompts", "0"])
