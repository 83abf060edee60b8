"""The gateway describes every registered model family: a Kimi K3 checkpoint's facts come from its nested
text_config (vocab, context, eos), not from a DeepSeek-V3 parse."""
from __future__ import annotations

import json

from gateway.model_info import ModelFacts
from tests.engine.k3_checkpoint import make_k3_checkpoint


def test_k3_checkpoint_facts_come_from_text_config(tmp_path):
    """vocab_size, max_position_embeddings and eos_token_id are read through the model registry."""
    model_dir = make_k3_checkpoint(tmp_path)
    text = json.loads((model_dir / "config.json").read_text())["text_config"]
    facts = ModelFacts.from_dir(model_dir)
    assert facts.vocab_size == text["vocab_size"]
    assert facts.max_context == text["max_position_embeddings"]
    eos = text.get("eos_token_id", json.loads((model_dir / "config.json").read_text()).get("eos_token_id"))
    assert facts.eos_token_ids == ((eos,) if isinstance(eos, int) else tuple(eos))
