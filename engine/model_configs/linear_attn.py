"""linear_attn_config of Kimi Linear / Kimi K3: the KDA geometry and which layers are KDA or MLA.

Layer lists on disk are 1-indexed (kda_layers / full_attn_layers); everything this module exposes to
the rest of the engine is 0-indexed. transformers' save_pretrained also writes layer_types
("linear_attention" / "full_attention", 0-indexed positions); when both are present they must agree.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

LAYER_TYPE_KDA = "linear_attention"
LAYER_TYPE_MLA = "full_attention"


@dataclass(frozen=True)
class LinearAttnConfig:
    """KDA geometry (K = V = head_dim) and the 1-indexed layer lists exactly as on disk.

    gate_lower_bound None: Kimi Linear's decay g = -exp(A_log) * softplus(z); a number b (K3: -5.0):
    the "safe gate" g = b * sigmoid(exp(A_log) * z). use_full_rank_gate: output gate g_proj
    [H*K, hidden] instead of the low-rank g_a_proj / g_b_proj."""

    num_heads: int
    head_dim: int
    short_conv_kernel_size: int
    kda_layers: tuple[int, ...]
    full_attn_layers: tuple[int, ...]
    use_full_rank_gate: bool = False
    gate_lower_bound: float | None = None

    def __post_init__(self) -> None:
        for name in ("num_heads", "head_dim", "short_conv_kernel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"linear_attn_config.{name} must be a positive int, got {value!r}")
        if self.short_conv_kernel_size < 2:
            raise ValueError(f"linear_attn_config.short_conv_kernel_size must be >= 2, got {self.short_conv_kernel_size}")
        if self.gate_lower_bound is not None and not self.gate_lower_bound < 0:
            raise ValueError(f"linear_attn_config.gate_lower_bound must be negative, got {self.gate_lower_bound}")

    def check_layers(self, num_hidden_layers: int) -> None:
        """Raises a ValueError naming the list when the two lists do not partition 1..num_hidden_layers."""
        for name in ("kda_layers", "full_attn_layers"):
            ids = getattr(self, name)
            bad = [i for i in ids if not isinstance(i, int) or isinstance(i, bool) or not 1 <= i <= num_hidden_layers]
            if bad:
                raise ValueError(f"linear_attn_config.{name} holds ids outside 1..{num_hidden_layers} (1-indexed): {bad}")
            if len(set(ids)) != len(ids):
                raise ValueError(f"linear_attn_config.{name} repeats a layer id")
        both = sorted(set(self.kda_layers) & set(self.full_attn_layers))
        if both:
            raise ValueError(f"linear_attn_config.kda_layers and full_attn_layers both list layers {both}")
        missing = sorted(set(range(1, num_hidden_layers + 1)) - set(self.kda_layers) - set(self.full_attn_layers))
        if missing:
            raise ValueError(f"linear_attn_config.kda_layers / full_attn_layers leave layers {missing} (1-indexed) unassigned")

    def is_kda_layer(self, layer: int) -> bool:
        """layer is 0-indexed."""
        return layer + 1 in self.kda_layers

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], num_hidden_layers: int) -> LinearAttnConfig:
        """d: the whole (text) config; reads linear_attn_config, else transformers' flat linear_* keys and layer_types."""
        lac = d.get("linear_attn_config") or {}
        layer_types = d.get("layer_types")
        if layer_types is not None:
            if len(layer_types) != num_hidden_layers or set(layer_types) - {LAYER_TYPE_KDA, LAYER_TYPE_MLA}:
                raise ValueError(f"layer_types must list {num_hidden_layers} of {LAYER_TYPE_KDA!r} / {LAYER_TYPE_MLA!r}")
        if "kda_layers" in lac and "full_attn_layers" in lac:
            kda, full = tuple(lac["kda_layers"]), tuple(lac["full_attn_layers"])
            if layer_types is not None:
                derived = tuple(LAYER_TYPE_KDA if i + 1 in kda else LAYER_TYPE_MLA for i in range(num_hidden_layers))
                if derived != tuple(layer_types):
                    raise ValueError("layer_types disagrees with linear_attn_config.kda_layers / full_attn_layers")
        elif layer_types is not None:
            kda = tuple(i + 1 for i, kind in enumerate(layer_types) if kind == LAYER_TYPE_KDA)
            full = tuple(i + 1 for i, kind in enumerate(layer_types) if kind == LAYER_TYPE_MLA)
        else:
            raise ValueError("linear_attn_config.kda_layers / full_attn_layers (or layer_types) are required")
        config = cls(
            num_heads=lac.get("num_heads", d.get("linear_num_heads")),
            head_dim=lac.get("head_dim", d.get("linear_head_dim")),
            short_conv_kernel_size=lac.get("short_conv_kernel_size", d.get("linear_conv_kernel_dim", 4)),
            kda_layers=kda,
            full_attn_layers=full,
            use_full_rank_gate=bool(lac.get("use_full_rank_gate", False)),
            gate_lower_bound=None if lac.get("gate_lower_bound") is None else float(lac["gate_lower_bound"]),
        )
        config.check_layers(num_hidden_layers)
        return config
