"""DSpark draft configuration (K3_SPEC 5.2): a DFlash backbone (Qwen3-style layers, or K3 MLA layers in the
KimiK3DSparkMLADraftModel variant) + a Markov logit-bias head (vanilla, gated or rnn).

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

from engine.model_configs.model_config import RopeConfig
from engine.model_configs.base import MLA_OPTIONAL_POSITIVE, MLA_POSITIVE, MLAShape, check_int_fields
from engine.models.dflash import DFlashConfig
from engine.models.dspark_markov import MARKOV_KINDS

DRAFT_KEYS = ("target_layer_ids", "block_size", "mask_token_id", "markov_rank", "markov_head_type",
              "target_hidden_size", "use_confidence_head")
MLA_ARCHITECTURE = "KimiK3DSparkMLADraftModel"


@dataclass(frozen=True)
class MlaDraftShape(MLAShape):
    """The MLA-layer variant's attention (K3 MLA with RoPE on the rope part, no output gate): q through
    q_a_proj / q_a_layernorm / q_b_proj (q_lora_rank None: one q_proj), kv_a_proj_with_mqa -> latent
    kv_lora_rank (kv_a_layernorm) + rope part, kv_b_proj -> per head [k_nope | v]; one context-cache entry
    is kv_cache_dim wide: [kv_a_layernorm(c_kv) | RoPE(k_pe)]. rope_interleave: pairs (2i, 2i+1) rotate
    together (K3's checkpoints); False: half-split."""

    rope_interleave: bool = True

    def __post_init__(self) -> None:
        check_int_fields(self, positive=MLA_POSITIVE, optional_positive=MLA_OPTIONAL_POSITIVE)
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even for RoPE, got {self.qk_rope_head_dim}")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MlaDraftShape:
        missing = [k for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim") if d.get(k) is None]
        if missing:
            raise ValueError(f"DSpark MLA draft config is missing {missing}")
        q_lora = d.get("q_lora_rank")
        return cls(hidden_size=int(d["hidden_size"]), num_attention_heads=int(d["num_attention_heads"]),
                   q_lora_rank=None if q_lora is None else int(q_lora),
                   kv_lora_rank=int(d["kv_lora_rank"]), qk_nope_head_dim=int(d["qk_nope_head_dim"]),
                   qk_rope_head_dim=int(d["qk_rope_head_dim"]), v_head_dim=int(d["v_head_dim"]),
                   rope_interleave=bool(d.get("rope_interleave", True)))

    def to_dict(self) -> dict[str, Any]:
        return {"q_lora_rank": self.q_lora_rank, "kv_lora_rank": self.kv_lora_rank,
                "qk_nope_head_dim": self.qk_nope_head_dim, "qk_rope_head_dim": self.qk_rope_head_dim,
                "v_head_dim": self.v_head_dim, "rope_interleave": self.rope_interleave}


@dataclass(frozen=True)
class DSparkConfig:
    """Shape of a DSpark draft. use_confidence_head None: decided by the checkpoint's tensors."""

    backbone: DFlashConfig  # the layer shapes, target taps, gamma and mask id
    vocab_size: int
    markov_rank: int
    rope: RopeConfig
    markov_kind: str = "vanilla"
    use_confidence_head: bool | None = None
    mla: MlaDraftShape | None = None  # the MLA-layer variant (KimiK3DSparkMLADraftModel); None: Qwen3-style layers

    def __post_init__(self) -> None:
        if self.vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {self.vocab_size}")
        if self.markov_rank <= 0:
            raise ValueError(f"markov_rank must be positive, got {self.markov_rank}")
        if self.markov_kind not in MARKOV_KINDS:
            raise ValueError(f"markov_head_type {self.markov_kind!r} is not supported (supported: {MARKOV_KINDS})")
        if self.mla is not None and self.mla.hidden_size != self.backbone.hidden_size:
            raise ValueError(f"the MLA attention's hidden_size {self.mla.hidden_size} differs from the backbone's "
                             f"{self.backbone.hidden_size}")
        if self.backbone.mask_token_id >= self.vocab_size:
            raise ValueError(f"mask_token_id {self.backbone.mask_token_id} outside vocab_size {self.vocab_size}")

    # The attributes the engine reads from any draft config.
    @property
    def num_layers(self) -> int:
        return self.backbone.num_layers

    @property
    def draft_dim(self) -> int:
        return self.mla.kv_cache_dim if self.mla is not None else self.backbone.draft_dim

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
        mla = MlaDraftShape.from_dict(d) if is_mla_draft_config(d) else None
        # The MLA variant's backbone "head_dim" is its RoPE width (the draft's rotary tables are built for it).
        head_dim = mla.qk_rope_head_dim if mla else int(d.get("head_dim") or int(d["hidden_size"]) // heads)
        theta = float(d.get("rope_theta", 10000.0))
        backbone = DFlashConfig(
            hidden_size=int(d["hidden_size"]), num_layers=int(d["num_hidden_layers"]), num_heads=heads,
            num_kv_heads=heads if mla else int(d.get("num_key_value_heads") or heads), head_dim=head_dim,
            intermediate_size=int(d["intermediate_size"]), target_layer_ids=tuple(d["target_layer_ids"]),
            target_hidden_size=int(d.get("target_hidden_size") or d["hidden_size"]),
            block_size=int(d["block_size"]), mask_token_id=int(d["mask_token_id"]),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)), rope_theta=theta,
        )
        rope = RopeConfig.from_hf(d.get("rope_scaling") or d.get("rope_parameters"), theta,
                                  int(d.get("max_position_embeddings", 32768)))
        confidence = d.get("use_confidence_head")
        return cls(backbone=backbone, vocab_size=int(d["vocab_size"]), markov_rank=int(d["markov_rank"]), rope=rope,
                   markov_kind=str(d.get("markov_head_type", "vanilla")).lower(),
                   use_confidence_head=None if confidence is None else bool(confidence), mla=mla)

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
        if self.mla is not None:
            out.update(self.mla.to_dict(), architectures=[MLA_ARCHITECTURE])
            del out["head_dim"], out["num_key_value_heads"]
        return out


def is_mla_draft_config(data: dict[str, Any]) -> bool:
    return MLA_ARCHITECTURE in (data.get("architectures") or ()) or data.get("kv_lora_rank") is not None


def is_dspark_config(data: dict[str, Any]) -> bool:
    architectures = data.get("architectures") or ()
    return data.get("model_type") == "dspark" or "DSparkDraftModel" in architectures or MLA_ARCHITECTURE in architectures


def read_dspark_config(draft_dir: str | Path) -> DSparkConfig:
    return DSparkConfig.from_dict(json.loads((Path(draft_dir) / "config.json").read_text()))
