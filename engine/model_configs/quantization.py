"""quantization_config of a checkpoint: only compressed-tensors MXFP4 (Kimi K3's routed experts) is supported."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

QUANT_METHODS = ("compressed-tensors",)
FORMATS = ("mxfp4-pack-quantized",)


@dataclass(frozen=True)
class QuantizationConfig:
    """Weights of modules not matching `ignore` are stored as `format` with num_bits and one scale per
    group_size input columns (MXFP4: 4 bits, 32 columns, UE8M0 scales)."""

    quant_method: str
    format: str
    num_bits: int
    group_size: int
    ignore: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.quant_method not in QUANT_METHODS:
            raise ValueError(f"quantization_config.quant_method must be one of {QUANT_METHODS}, got {self.quant_method!r}")
        if self.format not in FORMATS:
            raise ValueError(f"quantization_config.format must be one of {FORMATS}, got {self.format!r}")
        if self.num_bits != 4:
            raise ValueError(f"quantization_config weights.num_bits must be 4 for MXFP4, got {self.num_bits!r}")
        if self.group_size != 32:
            raise ValueError(f"quantization_config weights.group_size must be 32 for MXFP4, got {self.group_size!r}")

    @property
    def is_mxfp4(self) -> bool:
        return "mxfp4" in self.format

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any] | None) -> QuantizationConfig | None:
        """None for an unquantized checkpoint; a ValueError naming the field for anything unsupported."""
        if not d:
            return None
        groups = d.get("config_groups") or {}
        if len(groups) != 1:
            raise ValueError(f"quantization_config.config_groups must hold exactly one group, got {len(groups)}")
        group = next(iter(groups.values()))
        weights = group.get("weights") or {}
        fmt = d.get("format", group.get("format"))
        for key in ("num_bits", "group_size"):
            if not isinstance(weights.get(key), int):
                raise ValueError(f"quantization_config.config_groups weights.{key} must be an int, got {weights.get(key)!r}")
        if group.get("input_activations"):
            raise ValueError("quantization_config.config_groups input_activations (activation quantization) is not supported")
        return cls(
            quant_method=str(d.get("quant_method")), format=str(fmt), num_bits=weights["num_bits"],
            group_size=weights["group_size"], ignore=tuple(str(x) for x in d.get("ignore") or ()),
        )
