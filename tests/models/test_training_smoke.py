"""The training entry point runs end to end on a toy config and writes loadable artefacts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from transformers import DeepseekV3ForCausalLM

from engine.models.dflash import load_draft

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_tiny_training_run_writes_loadable_model(tmp_path: Path) -> None:
    """--tiny trains a few steps; target, draft, tokenizer and card load and agree with each other."""
    out = tmp_path / "tiny"
    result = subprocess.run(
        [sys.executable, "-m", "training.train_default_model", "--tiny", "--out", str(out), "--threads", "1"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json",
                 "README.md", "draft/config.json", "draft/model.safetensors"):
        assert (out / name).is_file(), name

    target = DeepseekV3ForCausalLM.from_pretrained(out, dtype=torch.float32)
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    draft = load_draft(out / "draft")
    config = json.loads((out / "config.json").read_text())
    assert config["vocab_size"] == tokenizer.get_vocab_size()
    assert config["bos_token_id"] == tokenizer.token_to_id("<|bos|>")
    assert draft.config.mask_token_id == tokenizer.token_to_id("<|mask|>")
    assert draft.config.target_hidden_size == config["hidden_size"]
    assert max(draft.config.target_layer_ids) < config["num_hidden_layers"] - 1
    ids = torch.tensor([tokenizer.encode("import os\n").ids])
    assert target(ids).logits.shape == (1, ids.shape[1], config["vocab_size"])
    card = (out / "README.md").read_text()
    assert "loss_ratio_threshold: 0.60" in card
    assert "python -m training.train_default_model --tiny" in card
