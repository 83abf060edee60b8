"""Hybrid linear-attention models (Kimi K3): only some layers keep an MLA cache per token; the KDA layers
keep a fixed-size state per request instead. Pure arithmetic for the planner."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class HybridAttention:
    """mla_layers keep the paged latent cache; every KDA layer holds, per request and per TP rank, a conv
    window [conv_width, 3 * heads/tp * head_dim] (conv_bytes each, bf16 by default) and a recurrent state
    [heads/tp, head_dim, head_dim] (ssm_bytes each, fp32 by default)."""

    mla_layers: int
    kda_layers: int
    kda_heads: int
    kda_head_dim: int
    conv_width: int = 3
    conv_bytes: int = 2
    ssm_bytes: int = 4

    def __post_init__(self) -> None:
        for name in ("mla_layers", "kda_layers", "kda_heads", "kda_head_dim", "conv_width", "conv_bytes", "ssm_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")

    def state_bytes_per_request(self, tp_size: int) -> int:
        """Bytes of one request's KDA state on each TP rank (KDA heads split over ranks)."""
        if self.kda_heads % tp_size:
            raise ValueError(f"TP size {tp_size} does not divide the {self.kda_heads} KDA heads")
        heads = self.kda_heads // tp_size
        conv = self.conv_width * 3 * heads * self.kda_head_dim * self.conv_bytes
        ssm = heads * self.kda_head_dim * self.kda_head_dim * self.ssm_bytes
        return self.kda_layers * (conv + ssm)

    @classmethod
    def from_hf(cls, hf_config: dict[str, Any]) -> HybridAttention | None:
        """From a (text_)config's linear_attn_config (1-indexed layer lists); None for a pure-MLA model."""
        linear = hf_config.get("linear_attn_config")
        if not isinstance(linear, dict):
            return None
        return cls(mla_layers=len(linear.get("full_attn_layers") or ()), kda_layers=len(linear.get("kda_layers") or ()),
                   kda_heads=int(linear["num_heads"]), kda_head_dim=int(linear["head_dim"]),
                   conv_width=int(linear.get("short_conv_kernel_size", 4)) - 1)


# Kimi K3 as published (K3_SPEC sections 1 and 4): 24 MLA layers, 69 KDA layers of 96 heads x 128.
KIMI_K3_ATTENTION = HybridAttention(mla_layers=24, kda_layers=69, kda_heads=96, kda_head_dim=128)
