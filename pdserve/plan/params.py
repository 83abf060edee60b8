"""Parameter count of a DeepSeek-V3-architecture model, computed from its config's shapes."""
from __future__ import annotations

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


def count_parameters(config: ModelConfig) -> ParamBreakdown:
    """Counts weights exactly as transformers' DeepseekV3ForCausalLM lays them out (no MTP layer)."""
    hidden = config.hidden_size
    heads = config.num_attention_heads
    q_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
    if config.q_lora_rank is None:
        q_sharded, q_replicated, q_norm = hidden * heads * q_head_dim, 0, 0
    else:
        q_sharded = config.q_lora_rank * heads * q_head_dim
        q_replicated, q_norm = hidden * config.q_lora_rank, config.q_lora_rank
    kv_a = hidden * (config.kv_lora_rank + config.qk_rope_head_dim)
    kv_b = config.kv_lora_rank * heads * (config.qk_nope_head_dim + config.v_head_dim)
    o_proj = heads * config.v_head_dim * hidden
    layers = config.num_hidden_layers
    moe_layers = sum(1 for layer in range(layers) if config.is_moe_layer(layer))
    dense_layers = layers - moe_layers
    expert = 3 * hidden * config.moe_intermediate_size  # gate, up, down
    per_layer_norms = 2 * hidden + q_norm + config.kv_lora_rank
    return ParamBreakdown(
        embedding=config.vocab_size * hidden,
        lm_head=0 if config.tie_word_embeddings else config.vocab_size * hidden,
        attention_sharded=layers * (q_sharded + kv_b + o_proj),
        attention_replicated=layers * (q_replicated + kv_a),
        dense_mlp=dense_layers * 3 * hidden * config.intermediate_size,
        shared_experts=moe_layers * config.n_shared_experts * expert,
        routed_experts=moe_layers * config.n_routed_experts * expert,
        router=moe_layers * (config.n_routed_experts * hidden + config.n_routed_experts),
        norms=layers * per_layer_norms + hidden,
    )
