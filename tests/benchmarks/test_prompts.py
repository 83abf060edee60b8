"""The held-out benchmark prompt set (benchmarks/prompts.py): exact lengths, every kind, held-out text only."""
from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.prompts import KINDS, held_out_prompts
from training.corpus import is_held_out

MODEL = Path(__file__).resolve().parents[2] / "models" / "pdserve-tiny"


@pytest.mark.skipif(not (MODEL / "tokenizer.json").is_file(), reason="the embedded model's tokenizer is missing")
def test_prompt_set_is_fixed_held_out_and_covers_every_kind():
    """16 prompts of exactly 64 tokens, the 8 kinds taking turns, each ending in a held-out file, no eos id;
    the same set on a second call."""
    prompts, source = held_out_prompts(MODEL, 16, 64, 4096, avoid=[1])
    assert len(prompts) == 16 and "held-out" in source
    assert [p.kind for p in prompts] == [name for name, _ in KINDS] * 2
    assert all(len(p.token_ids) == 64 and 1 not in p.token_ids for p in prompts)
    assert all(is_held_out(p.where.rsplit(":", 1)[0]) for p in prompts)
    assert len({tuple(p.token_ids) for p in prompts}) == 16
    again, _ = held_out_prompts(MODEL, 16, 64, 4096, avoid=[1])
    assert again == prompts


def test_without_a_tokenizer_the_prompts_are_random_ids(tmp_path):
    """A model directory without tokenizer.json gets uniform random ids of the asked length, kind 'random'."""
    prompts, source = held_out_prompts(tmp_path, 5, 12, 50, avoid=[0, 1])
    assert len(prompts) == 5 and "random" in source
    assert all(p.kind == "random" and len(p.token_ids) == 12 for p in prompts)
    assert all(0 < t < 50 and t != 1 for p in prompts for t in p.token_ids)
