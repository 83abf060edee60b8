"""Which draft a draft directory holds: DFlash-style (ours, model_type "dflash") or DSpark (published
layout, model_type "dspark" / architectures ["DSparkDraftModel"]); one entry point per use."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from engine.models.dflash import DFlashConfig, DFlashDraft, load_draft
from engine.models.dspark import build_dspark, load_dspark
from engine.models.dspark_config import DSparkConfig, is_dspark_config

DraftConfig = DFlashConfig | DSparkConfig


def read_any_draft_config(draft_dir: str | Path) -> DraftConfig:
    data = json.loads((Path(draft_dir) / "config.json").read_text())
    return DSparkConfig.from_dict(data) if is_dspark_config(data) else DFlashConfig.from_dict(data)


def load_any_draft(draft_dir: str | Path, dtype: torch.dtype, device: torch.device | str) -> DFlashDraft:
    if isinstance(read_any_draft_config(draft_dir), DSparkConfig):
        return load_dspark(draft_dir, dtype=dtype, device=device)
    return load_draft(draft_dir, dtype=dtype, device=device)


def build_any_draft(draft_dir: str | Path, dtype: torch.dtype) -> DFlashDraft:
    """The draft's modules without loading its weights (the shared weight store maps them in)."""
    config = read_any_draft_config(draft_dir)
    if isinstance(config, DSparkConfig):
        tensors = [p.name for p in Path(draft_dir).glob("*.safetensors")]
        confidence = config.use_confidence_head
        if confidence is None:
            from safetensors import safe_open

            confidence = any("confidence_head.proj.weight" in safe_open(str(Path(draft_dir, name)), "pt").keys()
                             for name in tensors)
        return build_dspark(config, dtype, "cpu", confidence)
    return DFlashDraft(config).to(dtype)
