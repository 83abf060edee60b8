"""Parameter count of a DeepSeek-V3-architecture model, by group, from the weight shapes the engine expects."""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

from engine.config import ModelConfig

# Groups every TP rank holds in full (MLA's down-projections, the router, the norms); the rest is split.
REPLICATED_GROUPS = ("attention_replicated", "router", "norms")


@dataclass(frozen=True)
class ParamBreakdown:
    """Parameters by group. Multi-token-prediction (MTP) layers are not counted: DeepSeek-V3's
    671B headline excludes its 14B MTP module, and serving here does not load it."""

    embedding: int
    lm_head: int
    attention_sharded: int  # q_b_proj (or q_proj), kv_b_proj, o_proj: split over heads
    attention_replicated: int  # q_a_proj, kv_a_proj_with_mqa: the same on every rank
    dense_mlp: int
    shared_experts: int
    routed_experts: int
    router: int  # gate weight + e_score_correction_bias
    norms: int

    def __post_init__(self) -> None:
        for item in fields(self):
            value = getattr(self, item.name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"parameter group {item.name} must be a non-negative int, got {value!r}")

    @property
    def total(self) -> int:
        return sum(getattr(self, item.name) for item in fields(self))

    def as_dict(self) -> dict[str, int]:
        return {item.name: getattr(self, item.name) for item in fields(self)}

    def scaled_to(self, total: int) -> ParamBreakdown:
        """Every group scaled by total / self.total (used by --params: the mix of groups is kept)."""
        if total <= 0:
            raise ValueError(f"parameter count must be positive, got {total}")
        factor = total / self.total
        return replace(self, **{name: round(value * factor) for name, value in self.as_dict().items()})


_ATTENTION_SHARDED = ("q_proj", "q_b_proj", "kv_b_proj", "o_proj")  # split over heads
_ATTENTION_REPLICATED = ("q_a_proj", "kv_a_proj_with_mqa")


def weight_group(name: str) -> str:
    """The ParamBreakdown group of one checkpoint tensor (an HF name of engine.weights.expected_weight_shapes)."""
    if name == "model.embed_tokens.weight":
        return "embedding"
    if name == "lm_head.weight":
        return "lm_head"
    if name.endswith("norm.weight"):
        return "norms"
    module = name.rsplit(".", 2)[-2]  # the module owning the tensor: "q_b_proj", "gate", "up_proj", ...
    if ".self_attn." in name:
        if module in _ATTENTION_SHARDED:
            return "attention_sharded"
        if module in _ATTENTION_REPLICATED:
            return "attention_replicated"
    elif ".mlp.experts." in name:
        return "routed_experts"
    elif ".mlp.shared_experts." in name:
        return "shared_experts"
    elif ".mlp.gate." in name:
        return "router"
    elif ".mlp." in name:
        return "dense_mlp"
    raise ValueError(f"no parameter group for weight {name!r}")


def count_parameters(config: ModelConfig) -> ParamBreakdown:
    """Counts the weights the engine loads for `config` (engine.weights.expected_weight_shapes: the layout
    of transformers' DeepseekV3ForCausalLM, no MTP layer), by group."""
    from engine.weights import expected_weight_shapes  # torch: only when counting

    groups = dict.fromkeys((item.name for item in fields(ParamBreakdown)), 0)
    for name, shape in expected_weight_shapes(config).items():
        groups[weight_group(name)] += math.prod(shape)
    return ParamBreakdown(**groups)
