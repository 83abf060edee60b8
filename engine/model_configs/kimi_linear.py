"""Configuration of Kimi Linear (model_type "kimi_linear", flat) and Kimi K3 ("kimi_k3", nested text_config).

K3's decoder config IS a kimi_linear text_config with extra fields (LatentMoE, SiTU, Attention
Residuals, output-gated MLA, safe KDA gate, MXFP4 experts); one dataclass holds both, model_type
says which. Field names are the checkpoint's (Moonshot / transformers) names. Parsing lives in
engine/model_configs/kimi_parse.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.config import check_tp_split
from engine.config_base import MLAShape, alias, length_of
from engine.model_configs.linear_attn import LinearAttnConfig
from engine.model_configs.quantization import QuantizationConfig

if TYPE_CHECKING:
    import torch

    from engine.state_pool import StateShape

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
        from engine.model_configs.kimi_checks import check_kimi_config

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

        from engine.state_pool import StateShape

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
        from engine.model_configs.kimi_parse import parse_kimi_config

        return parse_kimi_config(d)

    @classmethod
    def from_pretrained(cls, model_dir) -> KimiLinearConfig:
        from engine.model_configs.kimi_parse import read_config_json

        return cls.from_hf_dict(read_config_json(model_dir))
