"""model_type (config.json) -> the module that builds the model; modules are imported only when used.

An entry names the model module, which provides
`load_model(model_dir, tp, attention, dtype, device="cpu") -> (config, model)`, the model class
(`Class(config, tp, attention, dtype)` builds it without weights) and the config class,
which provides `from_pretrained(model_dir)`. The model follows
DeepseekV3ForCausalLM's interface (embed, forward(batch, cache, capture_layers), compute_logits,
load_weights, .config). A config provides num_cache_layers, kv_lora_rank, qk_rope_head_dim,
num_attention_heads, has_linear_attention and state_shape(tp_size, num_slots, conv_dtype).
"""
from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:  # the gateway reads configs through this module without importing torch
    import torch

class ModelEntry(NamedTuple):
    model_module: str
    model_class: str
    config_module: str
    config_class: str


_KIMI_CONFIG = ("engine.model_configs.kimi_linear", "KimiLinearConfig")
MODELS: dict[str, ModelEntry] = {
    "deepseek_v3": ModelEntry("engine.models.deepseek_v3", "DeepseekV3ForCausalLM", "engine.model_configs.model_config", "ModelConfig"),
    "kimi_linear": ModelEntry("engine.models.kimi_linear", "KimiLinearForCausalLM", *_KIMI_CONFIG),
    "kimi_k3": ModelEntry("engine.models.kimi_k3", "KimiK3ForCausalLM", *_KIMI_CONFIG),
}


def model_type_of(model_dir: str | Path) -> str:
    """config.json's model_type (a config without one is read as deepseek_v3, the engine's original model)."""
    with (Path(model_dir) / "config.json").open() as f:
        return json.load(f).get("model_type") or "deepseek_v3"


def entry(model_type: str) -> ModelEntry:
    if model_type not in MODELS:
        raise ValueError(f"model_type {model_type!r} is not supported (supported: {', '.join(sorted(MODELS))})")
    return MODELS[model_type]


def load_config(model_dir: str | Path) -> Any:
    """The parsed config of the checkpoint in model_dir, of the class its model_type registers."""
    found = entry(model_type_of(model_dir))
    return getattr(importlib.import_module(found.config_module), found.config_class).from_pretrained(model_dir)


def load_model(
    model_dir: str | Path, tp: Any, attention: Any, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> tuple[Any, Any]:
    """(config, model) for this tensor-parallel rank, weights loaded, eval mode."""
    module = importlib.import_module(entry(model_type_of(model_dir)).model_module)
    return module.load_model(model_dir, tp, attention, dtype, device)


def build_model(model_dir: str | Path, config: Any, tp: Any, attention: Any, dtype: torch.dtype,
                device: torch.device | str = "cpu") -> Any:
    """This rank's model of model_dir's model_type, built from `config` without loading weights, in the form
    load_model gives on `device` (a model module's build_empty, where it has one: e.g. FP8 layers on a GPU,
    built on the meta device for an importer that binds every tensor)."""
    found = entry(model_type_of(model_dir))
    module = importlib.import_module(found.model_module)
    if str(device).partition(":")[0] != "cpu" and hasattr(module, "build_empty"):
        return module.build_empty(model_dir, config, tp, attention, dtype, device)
    return getattr(module, found.model_class)(config, tp, attention, dtype)
