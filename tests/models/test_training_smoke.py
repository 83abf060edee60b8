"""The training entry point runs end to end on a toy config and writes loadable artefacts."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from transformers import DeepseekV3ForCausalLM

from engine.models.dflash import load_draft

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _train_tiny(out: Path, *extra: str) -> None:
    command = [sys.executable, "-m", "training.train_default_model", "--tiny", "--out", str(out), "--threads", "1"]
    result = subprocess.run([*command, *extra], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One `--tiny` training run for the module (its tests copy it before changing anything)."""
    out = tmp_path_factory.mktemp("training_smoke") / "tiny"
    _train_tiny(out)
    return out


def test_tiny_training_run_writes_loadable_model(tiny_run: Path) -> None:
    """--tiny trains a few steps; target, draft, tokenizer and card load and agree with each other."""
    out = tiny_run
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


def test_draft_only_rerun_warm_starts_and_keeps_the_target(tiny_run: Path, tmp_path: Path) -> None:
    """--reuse-target --draft-init retrains only the draft: the target's bytes are unchanged, the draft starts from
    the given one, and the metrics keep the previous draft's figures, both commands and the target's seed (the
    draft's own --seed and time budget recorded beside them)."""
    out = tmp_path / "tiny"
    shutil.copytree(tiny_run, out)
    target_bytes = (out / "model.safetensors").read_bytes()
    old_metrics = json.loads((out / "training_metrics.json").read_text())
    rerun = ["--reuse-target", "--draft-init", str(out / "draft"), "--draft-prompt-lengths", "4", "8",
             "--draft-sequences", "8", "--draft-lr", "1e-3", "--seed", "5", "--draft-minutes", "30"]
    _train_tiny(out, *rerun)
    assert (out / "model.safetensors").read_bytes() == target_bytes
    metrics = json.loads((out / "training_metrics.json").read_text())
    assert metrics["command"] == old_metrics["command"] and "--draft-init" in metrics["draft_command"]
    assert metrics["previous_draft"]["acceptance_length"] == old_metrics["acceptance_length"]
    assert (metrics["draft_prompt_min"], metrics["draft_prompt_max"], metrics["draft_lr"]) == (4, 8, 1e-3)
    assert metrics["draft_init"] == str(out / "draft") and metrics["held_out_loss"] == old_metrics["held_out_loss"]
    assert (metrics["seed"], metrics["draft_seed"]) == (old_metrics["seed"], 5)  # the target's seed is kept
    assert (metrics["draft_budget_minutes"], metrics["draft_steps"]) == (30, metrics["draft_max_steps"])
    assert "Warm-started from the previous draft" in (out / "README.md").read_text()
    load_draft(out / "draft")
