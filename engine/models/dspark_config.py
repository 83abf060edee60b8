"""DSpark draft configuration (K3_SPEC 5.2): a Qwen3-style DFlash backbone + a Markov logit-bias head.

Read from a published draft's config.json (transformers-style keys: hidden_size, num_hidden_layers,
num_attention_heads, num_key_value_heads, head_dim, intermediate_size, rms_norm_eps, rope_theta,
rope_scaling, vocab_size) plus the draft keys target_layer_ids, block_size, mask_token_id and
markov_rank, either at top level or under "dflash_config" / "dspark_config".

block_size is the checkpoint's gamma: drafts per round. Slot k of the block [bonus, MASK x (gamma-1)]
predicts position L+k+1 ("DeepSpec" convention), so one verify step scores gamma + 1 tokens; the
engine's block size (verify length) is therefore verify_block_size = block_size + 1.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.config import RopeConfig
from engine.models.dflash import DFlashConfig

MARKOV_KINDS = ("vanilla",)
DRAFT_KEYS = ("target_layer_ids", "block_size", "mask_token_id", "markov_rank", "markov_head_type",
              "target_hidden_size", "use_confidence_head")


@dataclass(frozen=True)
class DSparkConfig:
    """Shape of a DSpark draft. use_confidence_head None: decided by the checkpoint's tensors."""

    backbone: DFlashConfig  # the layer shapes, target taps, gamma and mask id
    vocab_size: int
    markov_rank: int
    rope: RopeConfig
    markov_kind: str = "vanilla"
    use_confidence_head: bool | None = None

    def __post_init__(self) -> None:
        if self.vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {self.vocab_size}")
        if self.markov_rank <= 0:
            raise ValueError(f"markov_rank must be positive, got {self.markov_rank}")
        if self.markov_kind not in MARKOV_KINDS:
            raise ValueError(f"markov_head_type {self.markov_kind!r} is not supported (supported: {MARKOV_KINDS})")
        if self.backbone.mask_token_id >= self.vocab_size:
            raise ValueError(f"mask_token_id {self.backbone.mask_token_id} outside vocab_size {self.vocab_size}")

    # The attributes the engine reads from any draft config.
    @property
    def num_layers(self) -> int:
        return self.backbone.num_layers

    @property
    def draft_dim(self) -> int:
        return self.backbone.draft_dim

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        return self.backbone.target_layer_ids

    @property
    def mask_token_id(self) -> int:
        return self.backbone.mask_token_id

    @property
    def block_size(self) -> int:
        return self.backbone.block_size

    @property
    def verify_block_size(self) -> int:
        return self.backbone.block_size + 1

    @property
    def hidden_size(self) -> int:
        return self.backbone.hidden_size

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DSparkConfig:
        d = dict(data)
        for nested in ("dflash_config", "dspark_config"):
            d.update({k: v for k, v in (d.pop(nested, None) or {}).items() if k in DRAFT_KEYS})
        missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                               "vocab_size", "target_layer_ids", "block_size", "mask_token_id", "markov_rank")
                   if d.get(k) is None]
        if missing:
            raise ValueError(f"DSpark config is missing {missing}")
        heads = int(d["num_attention_heads"])
        head_dim = int(d.get("head_dim") or int(d["hidden_size"]) // heads)
        theta = float(d.get("rope_theta", 10000.0))
        backbone = DFlashConfig(
            hidden_size=int(d["hidden_size"]), num_layers=int(d["num_hidden_layers"]), num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads), head_dim=head_dim,
            intermediate_size=int(d["intermediate_size"]), target_layer_ids=tuple(d["target_layer_ids"]),
            target_hidden_size=int(d.get("target_hidden_size") or d["hidden_size"]),
            block_size=int(d["block_size"]), mask_token_id=int(d["mask_token_id"]),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)), rope_theta=theta,
        )
        rope = RopeConfig.from_hf(d.get("rope_scaling") or d.get("rope_parameters"), theta,
                                  int(d.get("max_position_embeddings", 32768)))
        confidence = d.get("use_confidence_head")
        return cls(backbone=backbone, vocab_size=int(d["vocab_size"]), markov_rank=int(d["markov_rank"]), rope=rope,
                   markov_kind=str(d.get("markov_head_type", "vanilla")),
                   use_confidence_head=None if confidence is None else bool(confidence))

    def to_dict(self) -> dict[str, Any]:
        """The published layout's config.json."""
        b = self.backbone
        out: dict[str, Any] = {
            "model_type": "dspark", "architectures": ["DSparkDraftModel"], "hidden_size": b.hidden_size,
            "num_hidden_layers": b.num_layers, "num_attention_heads": b.num_heads,
            "num_key_value_heads": b.num_kv_heads, "head_dim": b.head_dim, "intermediate_size": b.intermediate_size,
            "rms_norm_eps": b.rms_norm_eps, "rope_theta": self.rope.theta, "vocab_size": self.vocab_size,
            "target_layer_ids": list(b.target_layer_ids), "target_hidden_size": b.target_hidden_size,
            "block_size": b.block_size, "mask_token_id": b.mask_token_id, "markov_rank": self.markov_rank,
            "markov_head_type": self.markov_kind,
        }
        if self.rope.rope_type == "yarn":
            out["rope_scaling"] = {"rope_type": "yarn", "factor": self.rope.factor,
                                   "original_max_position_embeddings": self.rope.original_max_position_embeddings,
                                   "beta_fast": self.rope.beta_fast, "beta_slow": self.rope.beta_slow}
        if self.use_confidence_head is not None:
            out["use_confidence_head"] = self.use_confidence_head
        return out


def is_dspark_config(data: dict[str, Any]) -> bool:
    return data.get("model_type") == "dspark" or "DSparkDraftModel" in (data.get("architectures") or ())


def read_dspark_config(draft_dir: str | Path) -> DSparkConfig:
    return DSparkConfig.from_dict(json.loads((Path(draft_dir) / "config.json").read_text()))
