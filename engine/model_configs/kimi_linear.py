"""Configuration of Kimi Linear (model_type "kimi_linear", flat) and Kimi K3 ("kimi_k3", nested text_config).

K3's decoder config IS a kimi_linear text_config with extra fields (LatentMoE, SiTU, Attention
Residuals, output-gated MLA, safe KDA gate, MXFP4 experts); one dataclass holds both, model_type
says which. Field names are the checkpoint's (Moonshot / transformers) names. Parsing config.json into the
fields lives in engine/model_configs/kimi_parse.py; validation (check_kimi_config) here, below the class.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.model_configs.model_config import check_tp_split
from engine.model_configs.base import (
    MLA_OPTIONAL_POSITIVE, MLA_POSITIVE, MLAShape, alias, check_expert_groups, check_int_fields, check_positive,
    length_of,
)
from engine.model_configs.kimi_parse import parse_kimi_fields, read_config_json
from engine.model_configs.linear_attn import LinearAttnConfig
from engine.model_configs.quantization import QuantizationConfig

if TYPE_CHECKING:
    import torch

    from engine.cache.state_pool import StateShape

MODEL_TYPES = ("kimi_linear", "kimi_k3")
HIDDEN_ACTS = ("silu", "situ")
SSM_DTYPES = ("float32", "bfloat16")  # mamba_ssm_dtype: torch dtype names (torch is imported only for the engine)
# transformers' kimi_linear builds q_a_layernorm / kv_a_layernorm with the RMSNorm default eps.
HF_LATENT_NORM_EPS = 1e-6


@dataclass(frozen=True)
class KimiLinearConfig(MLAShape):
    """The MLA dimensions come from MLAShape (K3's MLA layers use no rope scaling: softmax_scale is its default)."""

    model_type: str
    vocab_size: int
    num_hidden_layers: int
    mla_use_nope: bool
    mla_use_output_gate: bool
    max_position_embeddings: int
    rms_norm_eps: float
    hidden_act: str
    activation_situ_beta: float | None
    activation_situ_linear_beta: float | None
    intermediate_size: int
    first_k_dense_replace: int
    moe_layer_freq: int
    num_experts: int
    num_experts_per_token: int
    num_shared_experts: int
    moe_intermediate_size: int
    routed_expert_hidden_size: int | None
    latent_moe_use_norm: bool
    moe_router_activation_func: str
    topk_method: str
    use_grouped_topk: bool
    num_expert_group: int
    topk_group: int
    moe_renormalize: bool
    routed_scaling_factor: float
    attn_res_block_size: int | None
    num_nextn_predict_layers: int
    linear_attn: LinearAttnConfig
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_id: tuple[int, ...]
    pad_token_id: int | None = None
    media_placeholder_token_id: int | None = None
    quantization: QuantizationConfig | None = None
    mamba_ssm_dtype: str = "float32"

    def __post_init__(self) -> None:
        check_kimi_config(self)

    # ---- MLA (engine.layers.mla reads MLAShape's fields and this) ----
    @property
    def mla_latent_norm_eps(self) -> float:
        """K3 builds q_a_layernorm / kv_a_layernorm with rms_norm_eps; transformers' kimi_linear with 1e-6."""
        return self.rms_norm_eps if self.model_type == "kimi_k3" else HF_LATENT_NORM_EPS

    # ---- DeepSeek-style MoE names (engine.layers.moe reads these) ----
    n_routed_experts = alias("num_experts")
    num_experts_per_tok = alias("num_experts_per_token")
    n_shared_experts = alias("num_shared_experts")
    n_group = alias("num_expert_group")
    scoring_func = alias("moe_router_activation_func")
    norm_topk_prob = alias("moe_renormalize")

    @property
    def shared_intermediate_size(self) -> int:
        return self.moe_intermediate_size * self.num_shared_experts

    # ---- layer kinds (0-indexed) ----
    def is_kda_layer(self, layer: int) -> bool:
        return self.linear_attn.is_kda_layer(layer)

    def is_mla_layer(self, layer: int) -> bool:
        return not self.linear_attn.is_kda_layer(layer)

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0

    @property
    def kda_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if self.is_kda_layer(i))

    @property
    def mla_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if self.is_mla_layer(i))

    def kda_index(self, layer: int) -> int:
        """Ordinal of KDA layer `layer` among the KDA layers (its row in the state pool)."""
        return self.kda_layer_ids.index(layer)

    def mla_index(self, layer: int) -> int:
        """Ordinal of MLA layer `layer` among the MLA layers (its layer in the page cache)."""
        return self.mla_layer_ids.index(layer)

    num_kda_layers = length_of("linear_attn.kda_layers")
    num_mla_layers = length_of("linear_attn.full_attn_layers")

    @property
    def num_cache_layers(self) -> int:
        """Layers of the paged latent cache (MLA layers only)."""
        return self.num_mla_layers

    @property
    def has_linear_attention(self) -> bool:
        return self.num_kda_layers > 0

    def state_shape(self, tp_size: int, num_slots: int, conv_dtype: torch.dtype) -> StateShape:
        """This rank's state-pool geometry: heads and q|k|v conv channels divided by tp_size."""
        import torch  # here, not at module level: the gateway reads this config without torch

        from engine.cache.state_pool import StateShape

        heads = self.linear_attn.num_heads // tp_size
        dim = self.linear_attn.head_dim
        return StateShape(
            num_kda_layers=self.num_kda_layers, num_slots=num_slots,
            conv_width=self.linear_attn.short_conv_kernel_size - 1, conv_channels=3 * heads * dim,
            num_heads=heads, head_k_dim=dim, head_v_dim=dim, conv_dtype=conv_dtype,
            ssm_dtype=getattr(torch, self.mamba_ssm_dtype),
        )

    @property
    def has_dense(self) -> bool:
        return not all(self.is_moe_layer(i) for i in range(self.num_hidden_layers))

    @property
    def has_moe(self) -> bool:
        return any(self.is_moe_layer(i) for i in range(self.num_hidden_layers))

    def validate_tp(self, tp_size: int) -> None:
        """Raises one ValueError listing every size that does not split over tp_size ranks."""
        check_tp_split(self, tp_size, [("num_attention_heads", self.num_attention_heads),
                                       ("linear_attn_config.num_heads", self.linear_attn.num_heads)])

    @classmethod
    def from_hf_dict(cls, d: dict) -> KimiLinearConfig:
        """d: a whole config.json of model_type kimi_linear or kimi_k3."""
        fields, mlp_layer_types = parse_kimi_fields(d)
        config = cls(**fields)
        if mlp_layer_types is not None:
            _check_mlp_layer_types(mlp_layer_types, config)
        return config

    @classmethod
    def from_pretrained(cls, model_dir) -> KimiLinearConfig:
        return cls.from_hf_dict(read_config_json(model_dir))


def _check_mlp_layer_types(kinds: list[str], config: KimiLinearConfig) -> None:
    """transformers' mlp_layer_types ('dense' / 'sparse') must agree with first_k_dense_replace / moe_layer_freq."""
    derived = ["sparse" if config.is_moe_layer(i) else "dense" for i in range(config.num_hidden_layers)]
    if list(kinds) != derived:
        raise ValueError(f"mlp_layer_types {list(kinds)} disagrees with first_k_dense_replace="
                         f"{config.first_k_dense_replace} / moe_layer_freq={config.moe_layer_freq}")


_POSITIVE = MLA_POSITIVE + (
    "vocab_size", "num_hidden_layers", "max_position_embeddings", "intermediate_size", "moe_layer_freq",
    "num_experts", "num_experts_per_token", "moe_intermediate_size", "num_expert_group", "topk_group",
)
_NON_NEGATIVE = ("first_k_dense_replace", "num_shared_experts", "num_nextn_predict_layers")
_OPTIONAL_POSITIVE = MLA_OPTIONAL_POSITIVE + ("routed_expert_hidden_size", "attn_res_block_size")


def check_kimi_config(c: KimiLinearConfig) -> None:
    """Every unsupported value is a ValueError naming its field."""
    if c.model_type not in MODEL_TYPES:
        raise ValueError(f"model_type must be one of {MODEL_TYPES}, got {c.model_type!r}")
    check_int_fields(c, _POSITIVE, _NON_NEGATIVE, _OPTIONAL_POSITIVE)
    c.linear_attn.check_layers(c.num_hidden_layers)
    if not c.mla_use_nope:
        raise ValueError("mla_use_nope=false (rotary MLA in a Kimi model) is not supported")
    if c.hidden_act not in HIDDEN_ACTS:
        raise ValueError(f"hidden_act must be one of {HIDDEN_ACTS}, got {c.hidden_act!r}")
    if c.hidden_act == "situ":
        for name in ("activation_situ_beta", "activation_situ_linear_beta"):
            value = getattr(c, name)
            if value is None or not value > 0:
                raise ValueError(f"{name} must be a positive number when hidden_act is 'situ', got {value!r}")
    if c.moe_router_activation_func != "sigmoid":
        raise ValueError(f"moe_router_activation_func must be 'sigmoid', got {c.moe_router_activation_func!r}")
    if c.topk_method != "noaux_tc":
        raise ValueError(f"topk_method must be 'noaux_tc', got {c.topk_method!r}")
    check_expert_groups(c, "num_experts", "num_experts_per_token", "num_expert_group")  # noaux_tc (checked above)
    if c.latent_moe_use_norm and c.routed_expert_hidden_size is None:
        raise ValueError("latent_moe_use_norm=true needs routed_expert_hidden_size")
    if c.num_nextn_predict_layers:
        raise ValueError(f"num_nextn_predict_layers={c.num_nextn_predict_layers}: MTP layers are not supported")
    if c.mamba_ssm_dtype not in SSM_DTYPES:
        raise ValueError(f"mamba_ssm_dtype must be one of {sorted(SSM_DTYPES)}, got {c.mamba_ssm_dtype!r}")
    check_positive(c, ("rms_norm_eps", "routed_scaling_factor"))
    if c.model_type == "kimi_linear":
        _check_kimi_linear_only(c)


def _check_kimi_linear_only(c: KimiLinearConfig) -> None:
    """The kimi_linear model (transformers' architecture) has none of K3's extra parts."""
    k3_only = {
        "routed_expert_hidden_size": c.routed_expert_hidden_size is not None,
        "attn_res_block_size": c.attn_res_block_size is not None,
        "mla_use_output_gate": c.mla_use_output_gate,
        "hidden_act": c.hidden_act != "silu",
        "quantization_config": c.quantization is not None,
        "linear_attn_config.use_full_rank_gate": c.linear_attn.use_full_rank_gate,
    }
    for name, used in k3_only.items():
        if used:
            raise ValueError(f"{name}: a Kimi K3 feature, not supported with model_type 'kimi_linear' "
                             "(use model_type 'kimi_k3')")
