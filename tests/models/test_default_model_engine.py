"""The shipped DeepSeek-V3-shaped model (models/pdserve-tiny, no longer the default) through the engine."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from engine import LLM, SamplingParams
from engine.paths import DSV3_MODEL_DIR
from training.corpus import load_corpus
from training.tokenizer import encode_documents

MODEL_DIR = DSV3_MODEL_DIR


@pytest.fixture(scope="module")
def llm():
    with LLM(str(MODEL_DIR)) as model:  # with its draft/ folder
        yield model


@pytest.fixture(scope="module")
def held_out_prompts() -> list[list[int]]:
    tokenizer = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    held = encode_documents(tokenizer, [doc.text for doc in load_corpus().held_out])
    stream = [token for doc in held for token in doc]
    stride = (len(stream) - 32) // 12
    return [stream[i * stride : i * stride + 32] for i in range(12)]


def test_llm_loads_the_shipped_model_and_draft(llm):
    """LLM(models/pdserve-tiny) loads it with its draft/ (speculation on)."""
    assert Path(llm.engine.config.model_dir).resolve() == MODEL_DIR.resolve()
    assert llm.engine.has_draft


@pytest.mark.slow  # a statistical quality check of the trained model
def test_engine_acceptance_length_at_block_8(llm, held_out_prompts):
    """Greedy speculative decoding with the shipped draft at block size 8 accepts >= 3.0 tokens per
    verify step (bonus token included) on held-out prompts, and its output equals plain greedy decoding."""
    spec = SamplingParams(max_new_tokens=64, temperature=0.0, block_size=8, ignore_eos=True)
    plain = SamplingParams(max_new_tokens=64, temperature=0.0, speculative=False, ignore_eos=True)
    before = llm.acceptance_stats.merge(type(llm.acceptance_stats)())
    with_spec = llm.generate(held_out_prompts, spec)
    stats = llm.acceptance_stats
    steps = stats.num_verify_steps - before.num_verify_steps
    accepted = (stats.num_accepted_drafts - before.num_accepted_drafts + steps) / steps
    print(f"engine acceptance length at B=8: {accepted:.3f} over {steps} verify steps")
    assert accepted >= 3.0
    assert with_spec == llm.generate(held_out_prompts, plain)


def test_engine_matches_transformers_on_the_shipped_model(llm):
    """The engine's logits for a Python prompt agree with transformers' on the shipped checkpoint."""
    from transformers import DeepseekV3ForCausalLM

    tokenizer = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    ids = tokenizer.encode("import os\nimport sys\n\ndef main(argv):\n    ").ids
    reference = DeepseekV3ForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0]
    assert (llm.logits(ids) - expected).abs().max().item() < 1e-3
