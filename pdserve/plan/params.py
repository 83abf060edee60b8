"""Parameter count of a DeepSeek-V3-architecture model, by group, from the weight shapes the engine expects."""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

from engine.model_configs.model_config import ModelConfig

# Groups every TP rank holds in full (MLA's down-projections, the router, the norms, LatentMoE's latent
# projections); the rest is split.
REPLICATED_GROUPS = ("attention_replicated", "router", "norms", "latent_projections")


@dataclass(frozen=True)
class ParamBreakdown:
    """Parameters by group. Multi-token-prediction (MTP) layers are not counted: DeepSeek-V3's
    671B headline excludes its 14B MTP module, and serving here does not load it."""

    embedding: int
    lm_head: int
    attention_sharded: int  # q_b_proj (or q_proj), kv_b_proj, o_proj (+ K3: output gate, KDA q/k/v/f_b/b, convs)
    attention_replicated: int  # q_a_proj, kv_a_proj_with_mqa (+ K3's KDA f_a_proj): the same on every rank
    dense_mlp: int
    shared_experts: int
    routed_experts: int  # logical weights (an MXFP4 byte holds two)
    router: int  # gate weight + e_score_correction_bias
    norms: int  # RMSNorm weights (+ K3's Attention-Residual score vectors)
    latent_projections: int = 0  # K3 LatentMoE: routed_expert_down_proj / up_proj, replicated

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
    """The ParamBreakdown group of one checkpoint tensor (an HF name of engine.weights.checkpoint.expected_weight_shapes)."""
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


_K3_ATTENTION_REPLICATED = ("q_a_proj", "kv_a_proj_with_mqa", "f_a_proj", "g_a_proj")


def k3_weight_group(name: str) -> str | None:
    """The group of one Kimi K3 tensor (an engine name of engine.models.kimi_k3_weights.expected_k3_tensors);
    None for MXFP4 scales (their bits are in the expert format's bits per weight)."""
    if name.endswith(".weight_scale"):
        return None
    if name.endswith(("norm.weight", "_res_proj.weight")):
        return "norms"
    if ".mlp.experts." in name:
        return "routed_experts"
    if ".mlp.routed_expert_" in name:
        return "latent_projections"
    if ".self_attn." in name:
        module = name.split(".self_attn.", 1)[1].split(".", 1)[0]
        return "attention_replicated" if module in _K3_ATTENTION_REPLICATED else "attention_sharded"
    return weight_group(name)


def _k3_tensors(config) -> dict[str, tuple[int, ...]]:
    from engine.layers.kda import kda_weight_shapes
    from engine.models.kimi_k3_weights import expected_k3_tensors

    linear = config.linear_attn
    kda = kda_weight_shapes(config.hidden_size, linear.num_heads, linear.head_dim, linear.short_conv_kernel_size,
                            linear.use_full_rank_gate)
    return {name: shape for name, (shape, _) in expected_k3_tensors(config, lambda layer: kda).items()}


_COUNTED: dict[str, ParamBreakdown] = {}  # repr(config) -> its count: walking K3's ~10^5 tensor names takes ~1.5 s


def count_parameters(config) -> ParamBreakdown:
    """Counts the weights the engine loads for `config`, by group: a DeepSeek-V3 ModelConfig through
    engine.weights.checkpoint.expected_weight_shapes (transformers' DeepseekV3ForCausalLM layout, no MTP layer), Kimi K3
    through engine.models.kimi_k3_weights.expected_k3_tensors (MXFP4 experts: two weights per packed byte).
    Remembered per config (the configs are frozen dataclasses, so their repr names every field)."""
    key = repr(config)
    if key not in _COUNTED:
        _COUNTED[key] = _count(config)
    return _COUNTED[key]


def _count(config) -> ParamBreakdown:
    groups = dict.fromkeys((item.name for item in fields(ParamBreakdown)), 0)
    if isinstance(config, ModelConfig):
        from engine.weights.checkpoint import expected_weight_shapes  # torch: only when counting

        for name, shape in expected_weight_shapes(config).items():
            groups[weight_group(name)] += math.prod(shape)
        return ParamBreakdown(**groups)
    for name, shape in _k3_tensors(config).items():
        group = k3_weight_group(name)
        if group is not None:
            groups[group] += math.prod(shape) * (2 if name.endswith(".weight_packed") else 1)
    return ParamBreakdown(**groups)
