"""A tiny model directory for service tests: a random DeepSeek-V3 checkpoint (24 heads: 12 per rank at
TP=2) with a 4096-token context, the test tokenizer.json and, optionally, a random block-diffusion draft."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from tests.engine.tiny_models import make_tiny_checkpoint
from tests.gateway.text_tokenizer import make_tokenizer

CONTEXT = 4096
MASK_TOKEN_ID = 3


def make_service_model(root: str | Path, with_draft: bool = True) -> Path:
    """root/service-model: config.json (+ weights), tokenizer.json, draft/ (when with_draft)."""
    root = Path(root)
    out = root / ("service-model" if with_draft else "service-model-nodraft")
    if (out / "config.json").exists():
        return out
    source = make_tiny_checkpoint(root / "checkpoints", "heads24")
    shutil.copytree(source, out)
    config = json.loads((out / "config.json").read_text())
    config["max_position_embeddings"] = CONTEXT
    (out / "config.json").write_text(json.dumps(config, indent=2))
    make_tokenizer(out)
    if with_draft:
        from engine.models.dflash import DFlashConfig, DFlashDraft, save_draft

        torch.manual_seed(0)
        draft = DFlashDraft(DFlashConfig(
            hidden_size=config["hidden_size"], num_layers=1, num_heads=2, num_kv_heads=2, head_dim=16,
            intermediate_size=64, target_layer_ids=(0, 1), target_hidden_size=config["hidden_size"], block_size=4,
            mask_token_id=MASK_TOKEN_ID))
        save_draft(draft, out / "draft", dtype=torch.float32)
    return out
