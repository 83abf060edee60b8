"""The shape of a DFlash-style block-diffusion draft (engine/models/dflash.py), as its draft directory's
config.json records it."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from engine.model_configs.base import check_positive


@dataclass(frozen=True)
class DFlashConfig:
    """Shape of a draft; read from the draft directory's config.json."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    target_layer_ids: tuple[int, ...]
    target_hidden_size: int
    block_size: int
    mask_token_id: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        check_positive(self, ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                              "intermediate_size", "target_hidden_size", "rms_norm_eps", "rope_theta"))
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if not self.target_layer_ids or any(i < 0 for i in self.target_layer_ids):
            raise ValueError(f"target_layer_ids must be non-empty and >= 0, got {self.target_layer_ids}")
        if len(set(self.target_layer_ids)) != len(self.target_layer_ids):
            raise ValueError(f"target_layer_ids must be distinct, got {self.target_layer_ids}")
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block_size}")
        if self.mask_token_id < 0:
            raise ValueError(f"mask_token_id must be >= 0, got {self.mask_token_id}")

    @property
    def draft_dim(self) -> int:
        """Width of one context-cache entry per layer: cat(k, v) over kv heads."""
        return 2 * self.num_kv_heads * self.head_dim

    @property
    def verify_block_size(self) -> int:
        """Largest verify step (last token + drafts) this draft fills: block_size (slot 0 is the last token)."""
        return self.block_size

    @property
    def context_input_size(self) -> int:
        return len(self.target_layer_ids) * self.target_hidden_size

    @classmethod
    def from_dict(cls, data: dict) -> DFlashConfig:
        known = {f.name for f in fields(cls)}
        data = {k: v for k, v in data.items() if k not in ("model_type", "architectures")}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown DFlashConfig fields: {unknown}")
        return cls(**data)

    def to_dict(self) -> dict:
        return {"model_type": "dflash", **asdict(self), "target_layer_ids": list(self.target_layer_ids)}


def read_draft_config(draft_dir: str | Path) -> DFlashConfig:
    return DFlashConfig.from_dict(json.loads((Path(draft_dir) / "config.json").read_text()))
