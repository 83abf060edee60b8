"""Tiny target checkpoints with a random (deliberately poor) block-diffusion draft beside them."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from engine.models.dflash import DFlashConfig, DFlashDraft, save_draft
from tests.engine.tiny_models import make_tiny_checkpoint, tiny_config_kwargs


def add_random_draft(model_dir: Path, block_size: int = 16, seed: int = 0, num_layers: int = 1) -> Path:
    """Writes model_dir/draft with random weights; its mask token is the last vocabulary id."""
    config = json.loads((model_dir / "config.json").read_text())
    hidden, layers, vocab = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    draft_config = DFlashConfig(
        hidden_size=hidden, num_layers=num_layers, num_heads=4, num_kv_heads=2, head_dim=16,
        intermediate_size=2 * hidden, target_layer_ids=tuple(range(max(1, layers - 1))),
        target_hidden_size=hidden, block_size=block_size, mask_token_id=vocab - 1,
    )
    torch.manual_seed(seed)
    draft = DFlashDraft(draft_config)
    save_draft(draft, model_dir / "draft", dtype=torch.float32)
    return model_dir / "draft"


def make_small_vocab_checkpoint(model_dir: Path, vocab_size: int = 16, seed: int = 0) -> Path:
    """A heads24-shaped random model with a tiny vocabulary (so token distributions can be tested)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    kwargs = tiny_config_kwargs("heads24")
    kwargs.update(vocab_size=vocab_size, bos_token_id=0, eos_token_id=1)
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**kwargs)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lm_head" in name:
                param.mul_(20.0)  # sharper, prompt-dependent next-token distributions
    model.save_pretrained(model_dir)
    return model_dir


__all__ = ["add_random_draft", "make_small_vocab_checkpoint", "make_tiny_checkpoint"]
