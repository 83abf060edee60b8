"""Checkpoint loading: single file, sharded index, transformers' fused expert tensors, FP8 128x128-style
block weights (dequantised on load), MTP layers skipped, and one ValueError that names every
missing, unexpected and mis-shaped tensor."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.attention.torch_backend import TorchAttentionBackend
from engine.model_configs.model_config import ModelConfig
from engine.runtime.distributed import TPGroup
from engine.runtime.forward_batch import ForwardMode
from engine.models.deepseek_v3 import DeepseekV3ForCausalLM, load_model
from engine.weights.sharding import owned_elsewhere
from engine.weights.checkpoint import dequantize_fp8_block, expected_weight_shapes, iter_checkpoint, quantize_fp8_block
from tests.engine.tiny_models import PagedRunner

VARIANT = "yarn"


def _write(source: Path, target: Path, tensors: dict[str, torch.Tensor], shards: int = 1, config_extra: dict | None = None) -> Path:
    """Writes tensors as a checkpoint next to a copy of source's config.json (sharded with an index when shards > 1)."""
    target.mkdir(parents=True, exist_ok=True)
    config = json.loads((source / "config.json").read_text())
    config.update(config_extra or {})
    (target / "config.json").write_text(json.dumps(config))
    names = sorted(tensors)
    if shards == 1:
        save_file({n: tensors[n].contiguous() for n in names}, str(target / "model.safetensors"))
        return target
    weight_map = {}
    for shard in range(shards):
        file = f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"
        part = names[shard::shards]
        save_file({n: tensors[n].contiguous() for n in part}, str(target / file))
        weight_map.update({n: file for n in part})
    (target / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return target


def _load(path: Path) -> DeepseekV3ForCausalLM:
    return load_model(path, TPGroup(), TorchAttentionBackend(), torch.float32)[1]


def _assert_same_parameters(a: DeepseekV3ForCausalLM, b: DeepseekV3ForCausalLM) -> None:
    params_b = dict(b.named_parameters())
    for name, param in a.named_parameters():
        assert torch.equal(param, params_b[name]), name


@pytest.fixture(scope="module")
def source(tiny_checkpoint) -> tuple[Path, dict[str, torch.Tensor]]:
    path = tiny_checkpoint(VARIANT)
    return path, load_file(str(path / "model.safetensors"))


def test_single_file_yields_exactly_the_expected_tensors(source) -> None:
    """iter_checkpoint over transformers' save_pretrained output gives every expected name with its shape."""
    path, _ = source
    config = ModelConfig.from_pretrained(path)
    got = {name: tuple(t.shape) for name, t in iter_checkpoint(path, config.num_hidden_layers)}
    assert got == expected_weight_shapes(config)


def test_sharded_index_loads_like_single_file(source, tmp_path: Path) -> None:
    """A checkpoint split over three files with model.safetensors.index.json loads the same parameters."""
    path, tensors = source
    sharded = _write(path, tmp_path / "sharded", tensors, shards=3)
    assert len(list(sharded.glob("*.safetensors"))) == 3
    _assert_same_parameters(_load(sharded), _load(path))


def test_fused_expert_tensors_load_like_per_expert(source, tmp_path: Path) -> None:
    """transformers' in-memory layout experts.gate_up_proj [E, 2I, H] / experts.down_proj [E, H, I] loads
    into the same parameters as the per-expert names."""
    path, tensors = source
    config = ModelConfig.from_pretrained(path)
    fused = dict(tensors)
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}.mlp.experts"
        if not config.is_moe_layer(layer):
            continue
        experts = range(config.n_routed_experts)
        gate_up = [torch.cat([fused.pop(f"{prefix}.{e}.gate_proj.weight"), fused.pop(f"{prefix}.{e}.up_proj.weight")]) for e in experts]
        fused[f"{prefix}.gate_up_proj"] = torch.stack(gate_up)
        fused[f"{prefix}.down_proj"] = torch.stack([fused.pop(f"{prefix}.{e}.down_proj.weight") for e in experts])
    _assert_same_parameters(_load(_write(path, tmp_path / "fused", fused)), _load(path))


def test_mtp_layers_are_ignored(source, tmp_path: Path) -> None:
    """Tensors of layers >= num_hidden_layers (multi-token prediction) are skipped, not reported."""
    path, tensors = source
    config = ModelConfig.from_pretrained(path)
    mtp = config.num_hidden_layers
    extra = {
        f"model.layers.{mtp}.enorm.weight": torch.ones(config.hidden_size),
        f"model.layers.{mtp}.eh_proj.weight": torch.randn(config.hidden_size, 2 * config.hidden_size),
        f"model.layers.{mtp}.mlp.experts.0.gate_proj.weight": torch.randn(3, 3),
    }
    with_mtp = _write(path, tmp_path / "mtp", {**tensors, **extra})
    assert not any(name.startswith(f"model.layers.{mtp}.") for name, _ in iter_checkpoint(with_mtp, mtp))
    _assert_same_parameters(_load(with_mtp), _load(path))


def test_fp8_block_dequantisation_within_fp8_error() -> None:
    """quantise -> dequantise with 128x128 blocks (ragged edges) stays within e4m3 rounding error."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(300, 260, generator=generator) * torch.logspace(-3, 1, 260)  # blocks of very different scale
    quantised, scale_inv = quantize_fp8_block(weight)
    assert quantised.dtype == torch.float8_e4m3fn and scale_inv.shape == (3, 3)
    restored = dequantize_fp8_block(quantised, scale_inv)
    block_scale = scale_inv.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :260]
    bound = weight.abs() * 2.0 ** -4 + block_scale * 2.0 ** -9  # 3 mantissa bits; subnormal step
    assert ((restored - weight).abs() <= bound).all()
    assert (restored - weight).abs().max() > 0  # really went through fp8


def test_fp8_checkpoint_loads_and_runs(source, tmp_path: Path) -> None:
    """An FP8 checkpoint (weight e4m3 + weight_scale_inv, 16x16 blocks from config.json) loads into exactly
    the dequantised weights and runs: the same logits as a float checkpoint of those weights."""
    path, tensors = source
    fp8, dequantised = {}, {}
    for name, tensor in tensors.items():
        quantise = tensor.dim() == 2 and "embed_tokens" not in name and "lm_head" not in name and ".gate." not in name
        if not quantise:
            fp8[name] = dequantised[name] = tensor
            continue
        weight, scale_inv = quantize_fp8_block(tensor, (16, 16))
        fp8[name], fp8[name + "_scale_inv"] = weight, scale_inv
        dequantised[name] = dequantize_fp8_block(weight, scale_inv, (16, 16))
        assert ((dequantised[name] - tensor).abs() <= tensor.abs() * 2.0 ** -4 + scale_inv.max() * 2.0 ** -9).all()
    quant = {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [16, 16]}}
    fp8_model = _load(_write(path, tmp_path / "fp8", fp8, shards=2, config_extra=quant))
    float_model = _load(_write(path, tmp_path / "float", dequantised))
    _assert_same_parameters(fp8_model, float_model)
    config = ModelConfig.from_pretrained(path)
    tokens = [[(7 * i) % config.vocab_size for i in range(25)]]
    logits_fp8, _ = PagedRunner(fp8_model, config).step(ForwardMode.EXTEND, [(0, tokens[0])])
    logits_float, _ = PagedRunner(float_model, config).step(ForwardMode.EXTEND, [(0, tokens[0])])
    assert torch.isfinite(logits_fp8).all()
    torch.testing.assert_close(logits_fp8, logits_float, atol=1e-6, rtol=0)


def test_fp8_weight_without_scale_is_rejected(source, tmp_path: Path) -> None:
    """An e4m3 tensor with no weight_scale_inv cannot be read silently as numbers."""
    path, tensors = source
    name = "model.layers.0.self_attn.o_proj.weight"
    broken = _write(path, tmp_path / "noscale", {**tensors, name: tensors[name].to(torch.float8_e4m3fn)})
    with pytest.raises(ValueError, match="o_proj.weight_scale_inv"):
        list(iter_checkpoint(broken))


def test_all_offending_tensors_in_one_error(source, tmp_path: Path) -> None:
    """Missing, unexpected and mis-shaped tensors are all named in ONE ValueError."""
    path, tensors = source
    broken = dict(tensors)
    del broken["model.layers.0.self_attn.o_proj.weight"]
    del broken["model.layers.2.mlp.experts.5.up_proj.weight"]
    broken["model.layers.1.mlp.bogus.weight"] = torch.zeros(2)
    broken["model.norm.weight"] = torch.ones(7)
    broken["model.layers.1.self_attn.kv_b_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError) as info:
        _load(_write(path, tmp_path / "broken", broken))
    message = str(info.value)
    for name in ("model.layers.0.self_attn.o_proj.weight", "model.layers.2.mlp.experts.5.up_proj.weight",
                 "model.layers.1.mlp.bogus.weight", "model.norm.weight", "model.layers.1.self_attn.kv_b_proj.weight"):
        assert name in message
    assert "2 missing" in message and "1 unexpected" in message and "2 mis-shaped" in message


def test_checkpoint_dir_without_weights_is_an_error(source, tmp_path: Path) -> None:
    """A directory with config.json but no safetensors raises FileNotFoundError."""
    path, _ = source
    shutil.copy(path / "config.json", tmp_path / "config.json")
    with pytest.raises(FileNotFoundError):
        list(iter_checkpoint(tmp_path))


def test_experts_of_other_ranks_are_not_read(source) -> None:
    """With skip=owned_elsewhere, rank 1 of 2 gets shape-only meta tensors for experts 0..E/2-1 (and only
    those), and loads exactly the parameters a full read gives."""
    path, _ = source
    config = ModelConfig.from_pretrained(path)
    tp = TPGroup(rank=1, size=2)
    skipped = [name for name, tensor in iter_checkpoint(path, config.num_hidden_layers,
                                                          skip=lambda n: owned_elsewhere(n, tp, config.n_routed_experts))
               if tensor.is_meta]
    half = config.n_routed_experts // 2
    moe_layers = [i for i in range(config.num_hidden_layers) if config.is_moe_layer(i)]
    assert sorted(skipped) == sorted(f"model.layers.{layer}.mlp.experts.{e}.{p}.weight" for layer in moe_layers
                                     for e in range(half) for p in ("gate_proj", "up_proj", "down_proj"))
    lazy = DeepseekV3ForCausalLM(config, tp, TorchAttentionBackend(), torch.float32)
    lazy.load_weights(iter_checkpoint(path, config.num_hidden_layers,
                                      skip=lambda n: owned_elsewhere(n, tp, config.n_routed_experts)))
    full = DeepseekV3ForCausalLM(config, tp, TorchAttentionBackend(), torch.float32)
    full.load_weights(iter_checkpoint(path, config.num_hidden_layers))
    _assert_same_parameters(lazy, full)
