"""Greedy speculative decoding on the K3-shaped default model (models/pdserve-k3-tiny: KDA + gated MLA target,
trained DSpark draft) emits exactly plain greedy decoding: 20 prompts, verify blocks 2, 4 and 8, one request
at a time and 8 running together (issue 14's first acceptance bullet)."""
from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer

from engine import LLM, SamplingParams
from training.corpus import load_corpus

MODEL = Path(__file__).resolve().parents[2] / "models" / "pdserve-k3-tiny"
NEW_TOKENS = 20
BLOCKS = (2, 4, 8)

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not (MODEL / "draft" / "config.json").is_file(), reason="models/pdserve-k3-tiny (with draft/) is not built")]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """20 held-out prompts of 12..31 tokens (different lengths: ragged batches)."""
    tokenizer = Tokenizer.from_file(str(MODEL / "tokenizer.json"))
    text = "".join(doc.text for doc in load_corpus().held_out)
    ids = tokenizer.encode(text).ids
    stride = len(ids) // 20
    return [ids[i * stride : i * stride + 12 + i] for i in range(20)]


@pytest.mark.parametrize("running", [1, 8])
def test_greedy_speculation_equals_plain_greedy(prompts, running: int) -> None:
    """For every block size the speculative outputs equal speculation-off outputs token for token, and the
    draft really was used (some drafts accepted), so the comparison is not vacuous."""
    with LLM(str(MODEL), device="cpu", num_threads=1, spec_block_size=max(BLOCKS), max_running=running) as llm:
        assert llm.engine.has_draft and llm.model_config.model_type == "kimi_k3"
        plain = llm.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True,
                                                     speculative=False))
        assert all(len(out) == NEW_TOKENS for out in plain)
        for block in BLOCKS:
            before = llm.acceptance_stats.num_accepted_drafts
            spec = llm.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True,
                                                        block_size=block))
            mismatched = [i for i, (a, b) in enumerate(zip(spec, plain)) if a != b]
            assert not mismatched, f"block {block}, running {running}: prompts {mismatched} differ"
            assert llm.acceptance_stats.num_accepted_drafts > before, f"block {block}: no draft accepted"
