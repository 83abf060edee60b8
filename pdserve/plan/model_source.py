"""Where the planner's model comes from: a preset name, or an HF config.json (file or model folder)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.model_configs.model_config import ModelConfig
from pdserve.plan.dtypes import Quantization, weight_format
from pdserve.plan.hybrid import HybridAttention
from pdserve.plan.presets import PRESETS


@dataclass(frozen=True)
class ModelSource:
    """A parsed model: its name, where it came from, its config, and its weight storage as shipped."""

    name: str
    source: str
    config: Any  # engine.model_configs.model_config.ModelConfig, or KimiLinearConfig for Kimi K3
    quantization: Quantization
    hybrid: HybridAttention | None = None


def quantization_from_hf(hf_config: dict[str, Any]) -> Quantization:
    """Reads quantization_config: fp8 (block scales) everywhere, or compressed-tensors 4-bit
    groups on the routed experts with the rest bf16 (Kimi K2-Thinking); anything else is bf16."""
    bf16 = weight_format("bf16")
    quant = hf_config.get("quantization_config")
    if not isinstance(quant, dict):
        return Quantization(bf16, bf16)
    if quant.get("quant_method") == "fp8":
        return Quantization(weight_format("fp8"), weight_format("fp8"))
    if "mxfp4" in str(quant.get("format", "")):  # compressed-tensors mxfp4-pack-quantized (Kimi K3)
        return Quantization(bf16, weight_format("mxfp4"))
    for group in (quant.get("config_groups") or {}).values():
        weights = group.get("weights") if isinstance(group, dict) else None
        if isinstance(weights, dict) and weights.get("num_bits") == 4:
            group_size = weights.get("group_size") or 32
            return Quantization(bf16, weight_format("int4", group_size=int(group_size)))
    return Quantization(bf16, bf16)


KIMI_MODEL_TYPES = ("kimi_k3",)


def parse_config(hf_config: dict[str, Any]) -> tuple[Any, Quantization, HybridAttention | None]:
    """(engine config, quantization as shipped, hybrid attention) of a whole config.json: Kimi K3 through the
    engine's K3 parser (text_config nested), anything else as a DeepSeek-V3-architecture config."""
    if hf_config.get("model_type") in KIMI_MODEL_TYPES:
        from engine.model_configs.kimi_linear import KimiLinearConfig

        text = hf_config["text_config"] if isinstance(hf_config.get("text_config"), dict) else {}
        quant = {"quantization_config": text.get("quantization_config") or hf_config.get("quantization_config")}
        return KimiLinearConfig.from_hf_dict(hf_config), quantization_from_hf(quant), HybridAttention.from_hf(text)
    if hf_config.get("model_type") == "kimi_linear":
        raise ValueError("Kimi Linear (model_type kimi_linear) is not planned yet; Kimi K3 (kimi_k3) is")
    if isinstance(hf_config.get("text_config"), dict):  # other multimodal wrappers nest the language model
        hf_config = {**hf_config["text_config"], "quantization_config": hf_config.get("quantization_config")}
    return ModelConfig.from_hf_dict(hf_config), quantization_from_hf(hf_config), HybridAttention.from_hf(hf_config)


def _read_config(path: Path) -> dict[str, Any]:
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"no config.json at {path} (and not a preset: {', '.join(PRESETS)})")
    try:
        data = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{file} is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file} must hold a JSON object, got {type(data).__name__}")
    return data


def load_model(spec: str) -> ModelSource:
    """spec: a preset name (case-insensitive) or a path to config.json or to the folder holding it."""
    preset = PRESETS.get(spec.strip().lower())
    if preset is not None:
        config, quantization, hybrid = parse_config(preset.hf_config)
        return ModelSource(preset.name, f"preset: {preset.description}", config,
                           preset.quantization or quantization, preset.hybrid or hybrid)
    path = Path(spec)
    hf_config = _read_config(path)
    try:
        config, quantization, hybrid = parse_config(hf_config)
    except (TypeError, KeyError, AttributeError) as error:
        raise ValueError(f"{path}: not a DeepSeek-V3-style or Kimi K3 config ({error})") from None
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from None
    name = path.name if path.is_dir() else path.parent.name or path.name
    return ModelSource(name, f"config.json: {path}", config, quantization, hybrid)
