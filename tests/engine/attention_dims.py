"""The attention head dims in use: the embedded models (models/*/config.json), the size presets of
pdserve/plan/presets.py and the random benchmark checkpoints (benchmarks/write_random_checkpoint.py), read from
those files (never listed by hand, so a new model or preset is covered without editing the tests)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

from engine.attention.triton_kernels.compile_check import AttentionDims

REPO = Path(__file__).resolve().parents[2]


def _dims(config: dict) -> AttentionDims:
    config = config.get("text_config", config)
    rope = config["qk_rope_head_dim"]
    return AttentionDims(config["qk_nope_head_dim"] + rope, config["v_head_dim"], config["kv_lora_rank"], rope)


def _benchmark_shapes() -> dict[str, dict]:
    path = REPO / "benchmarks" / "write_random_checkpoint.py"
    spec = importlib.util.spec_from_file_location("write_random_checkpoint", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.SHAPES


def attention_dims_in_use() -> dict[str, AttentionDims]:
    """{where from: dims} for every model with MLA attention this repository ships, presets or benchmarks."""
    import json

    from pdserve.plan.presets import PRESETS

    found: dict[str, AttentionDims] = {}
    for config_path in sorted((REPO / "models").glob("*/config.json")):
        found[f"models/{config_path.parent.name}"] = _dims(json.loads(config_path.read_text()))
    for name, preset in PRESETS.items():
        found[f"preset {name}"] = _dims(preset.hf_config)
    for name, shape in _benchmark_shapes().items():
        found[f"benchmark {name}"] = _dims(shape)
    return found


def distinct_dims() -> list[AttentionDims]:
    """Each distinct AttentionDims once, in a stable order."""
    return sorted(set(attention_dims_in_use().values()), key=str)
