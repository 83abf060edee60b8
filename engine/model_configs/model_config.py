"""Model configuration of a DeepSeek-V3-architecture checkpoint, parsed once from HF config.json."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from engine.model_configs.base import (
    MLA_OPTIONAL_POSITIVE, MLA_POSITIVE, MLAShape, check_expert_groups, check_int_fields, check_positive,
)

ROPE_TYPES = ("default", "yarn")
TOPK_METHODS = ("noaux_tc", "greedy")
SCORING_FUNCS = ("sigmoid", "softmax")
_POSITIVE = ("vocab_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers", "n_routed_experts",
             "num_experts_per_tok", "moe_layer_freq", "n_group", "topk_group", "max_position_embeddings")

# Keys without which a config.json cannot describe the model (no sensible default exists).
_REQUIRED = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
)
# transformers' DeepseekV3Config defaults for keys a config.json may leave out.
_DEFAULTS: dict[str, Any] = {
    "moe_intermediate_size": 2048, "q_lora_rank": 1536, "n_routed_experts": 256, "num_experts_per_tok": 8,
    "n_shared_experts": 1, "first_k_dense_replace": 3, "moe_layer_freq": 1, "n_group": 8, "topk_group": 4,
    "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True, "routed_scaling_factor": 2.5,
    "rope_interleave": True, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "max_position_embeddings": 4096,
    "hidden_act": "silu", "bos_token_id": 0, "eos_token_id": 1,
}


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN magnitude correction 0.1 * mscale * ln(scale) + 1 (1 when scale <= 1)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters (transformers' rope_parameters / v4 rope_theta + rope_scaling)."""

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None  # explicit override of the cos/sin scaling
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type must be one of {ROPE_TYPES}, got {self.rope_type!r}")
        if not self.theta > 0:
            raise ValueError(f"rope_theta must be positive, got {self.theta}")
        if self.rope_type == "yarn":
            if self.original_max_position_embeddings is None or self.original_max_position_embeddings <= 0:
                raise ValueError("rope original_max_position_embeddings must be a positive int for yarn")
            if not self.factor > 0:
                raise ValueError(f"rope factor must be positive, got {self.factor}")

    @property
    def cos_sin_scale(self) -> float:
        """What cos and sin are multiplied by (transformers' attention_scaling)."""
        if self.rope_type == "default":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return yarn_get_mscale(self.factor, self.mscale) / yarn_get_mscale(self.factor, self.mscale_all_dim)
        return yarn_get_mscale(self.factor)

    @classmethod
    def from_hf(cls, params: dict[str, Any] | None, default_theta: float, max_position_embeddings: int) -> RopeConfig:
        params = dict(params or {})
        rope_type = params.get("rope_type", params.get("type", "default"))
        theta = float(params.get("rope_theta", default_theta))
        if rope_type == "default":
            return cls(rope_type="default", theta=theta)
        if rope_type != "yarn":
            raise ValueError(f"rope_type must be one of {ROPE_TYPES}, got {rope_type!r}")
        original = params.get("original_max_position_embeddings", max_position_embeddings)
        factor = params.get("factor")
        if factor is None:
            factor = max_position_embeddings / original
        optional = {key: float(params[key]) for key in ("mscale", "mscale_all_dim", "attention_factor")
                    if params.get(key) is not None}
        return cls(
            rope_type="yarn", theta=theta, factor=float(factor), original_max_position_embeddings=int(original),
            beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
            truncate=bool(params.get("truncate", True)), **optional,
        )


def check_tp_split(config: Any, tp_size: int, head_checks: list[tuple[str, int]]) -> None:
    """One ValueError listing every size of a DeepSeek-style MLA + MoE config (head_checks, vocab, dense
    MLP, routed and shared experts) that does not split over tp_size ranks."""
    if tp_size < 1:
        raise ValueError(f"tensor-parallel size must be positive, got {tp_size}")
    checks = [*head_checks, ("vocab_size", config.vocab_size)]
    if config.has_dense:
        checks.append(("intermediate_size", config.intermediate_size))
    if config.has_moe:
        checks.append(("n_routed_experts", config.n_routed_experts))
        if config.n_shared_experts:
            checks.append(("moe_intermediate_size * n_shared_experts", config.shared_intermediate_size))
    problems = [f"{name}={value} is not divisible by tp_size={tp_size}" for name, value in checks if value % tp_size]
    if problems:
        raise ValueError("model cannot be split over tensor-parallel ranks: " + "; ".join(problems))


@dataclass(frozen=True)
class ModelConfig(MLAShape):
    """Everything the runtime needs to know about the model's shape and maths (the MLA dimensions come
    from MLAShape)."""

    vocab_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    first_k_dense_replace: int
    moe_layer_freq: int
    n_group: int
    topk_group: int
    topk_method: str
    scoring_func: str
    norm_topk_prob: bool
    routed_scaling_factor: float
    rope: RopeConfig
    rope_interleave: bool
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    hidden_act: str
    bos_token_id: int | None
    eos_token_id: tuple[int, ...]

    def __post_init__(self) -> None:
        check_int_fields(self, positive=MLA_POSITIVE + _POSITIVE, non_negative=("n_shared_experts", "first_k_dense_replace"),
                         optional_positive=MLA_OPTIONAL_POSITIVE)
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(f"topk_method must be one of {TOPK_METHODS}, got {self.topk_method!r}")
        if self.scoring_func not in SCORING_FUNCS:
            raise ValueError(f"scoring_func must be one of {SCORING_FUNCS}, got {self.scoring_func!r}")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act must be 'silu', got {self.hidden_act!r}")
        check_expert_groups(self, "n_routed_experts", "num_experts_per_tok", "n_group",
                            grouped_top2=self.topk_method == "noaux_tc")
        check_positive(self, ("rms_norm_eps", "routed_scaling_factor"))

    # ---- derived values ----
    @property
    def softmax_scale(self) -> float:
        """qk_head_dim ** -0.5, times yarn mscale(factor, mscale_all_dim) ** 2 (as transformers' yarn_apply_mscale)."""
        scale = self.qk_head_dim ** -0.5
        if self.rope.rope_type != "default" and self.rope.mscale_all_dim:
            mscale = yarn_get_mscale(self.rope.factor, self.rope.mscale_all_dim)
            scale *= mscale * mscale
        return scale

    @property
    def shared_intermediate_size(self) -> int:
        return self.moe_intermediate_size * self.n_shared_experts

    def is_moe_layer(self, layer: int) -> bool:
        """DeepSeek's rule: MoE from first_k_dense_replace on, every moe_layer_freq-th layer.
        (transformers 5.24 ignores moe_layer_freq; every released checkpoint uses 1, where both agree.)"""
        return layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0

    @property
    def has_moe(self) -> bool:
        return any(self.is_moe_layer(i) for i in range(self.num_hidden_layers))

    @property
    def has_dense(self) -> bool:
        return not all(self.is_moe_layer(i) for i in range(self.num_hidden_layers))

    @property
    def num_cache_layers(self) -> int:
        """Layers of the paged latent cache (every layer is MLA)."""
        return self.num_hidden_layers

    @property
    def has_linear_attention(self) -> bool:
        return False

    def state_shape(self, tp_size: int, num_slots: int, conv_dtype: object) -> None:
        """No per-sequence recurrent state (see KimiLinearConfig.state_shape)."""
        return None

    def validate_tp(self, tp_size: int) -> None:
        """Raises one ValueError listing every size that does not split over tp_size ranks."""
        check_tp_split(self, tp_size, [("num_attention_heads", self.num_attention_heads)])

    # ---- construction ----
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Accepts transformers v4 (rope_theta / rope_scaling at top level) and v5 (rope_parameters) layouts."""
        missing = [key for key in _REQUIRED if d.get(key) is None]
        if missing:
            raise ValueError(f"config.json lacks required field(s): {', '.join(missing)}")
        if d.get("attention_bias"):
            raise ValueError("attention_bias=True is not supported")
        values = {key: d.get(key, default) for key, default in _DEFAULTS.items()}
        values.update({key: d[key] for key in _REQUIRED})
        if "q_lora_rank" in d:
            values["q_lora_rank"] = d["q_lora_rank"]
        for key in ("n_group", "topk_group", "num_experts_per_tok", "first_k_dense_replace", "norm_topk_prob"):
            if values[key] is None:
                values[key] = _DEFAULTS[key]
        eos = values["eos_token_id"]
        values["eos_token_id"] = () if eos is None else (int(eos),) if isinstance(eos, int) else tuple(int(e) for e in eos)
        rope_params = d.get("rope_scaling") or d.get("rope_parameters")
        values["rope"] = RopeConfig.from_hf(
            rope_params, float(d.get("rope_theta", 10000.0)), int(values["max_position_embeddings"])
        )
        for key, kind in (("rope_interleave", bool), ("norm_topk_prob", bool), ("tie_word_embeddings", bool),
                          ("routed_scaling_factor", float), ("rms_norm_eps", float)):
            values[key] = kind(values[key])
        names = {f.name for f in fields(cls)}
        return cls(**{key: value for key, value in values.items() if key in names})

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        with path.open() as f:
            return cls.from_hf_dict(json.load(f))
