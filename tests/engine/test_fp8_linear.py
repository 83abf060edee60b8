"""FP8 weights kept FP8: a checkpoint read with keep_fp8 yields each e4m3 weight as stored followed by its
scale_inv; Fp8Linear (replicated, column- and row-parallel) computes x @ dequant(weight).T from its shard of
them, the shards of two ranks reassembling the full product; shards that split a quantisation block, and
mis-shaped weights, are refused. (On CPU the forward is the torch reference; the Triton kernel behind it on
GPUs is tested in test_fp8_gemm.py.)"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from engine.runtime.distributed import TPGroup
from engine.kernels.fp8_quant import dequantize_fp8_block, quantize_fp8_block
from engine.layers.fp8_linear import Fp8Linear, shard_block_scale
from engine.weights.checkpoint import iter_checkpoint

BLOCK = (16, 16)
OUT, IN = 64, 96


def _weights(seed: int = 0):
    weight = torch.randn(OUT, IN, generator=torch.Generator().manual_seed(seed))
    quantised, scale_inv = quantize_fp8_block(weight, BLOCK)
    return quantised, scale_inv, dequantize_fp8_block(quantised, scale_inv, BLOCK)


def _layer(parallel: str, rank: int = 0, size: int = 1, reduce: bool = True) -> Fp8Linear:
    quantised, scale_inv, _ = _weights()
    layer = Fp8Linear(IN, OUT, TPGroup(rank, size), parallel, BLOCK, reduce=reduce)
    layer.load_full(quantised, scale_inv)
    return layer


def test_keep_fp8_reads_weights_as_stored(tmp_path: Path):
    """iter_checkpoint(keep_fp8=True) yields the e4m3 tensor unchanged and its scale_inv; the default
    still yields the dequantised weight (the CPU path)."""
    quantised, scale_inv, dequantised = _weights()
    name = "model.layers.0.self_attn.o_proj.weight"
    save_file({name: quantised, name + "_scale_inv": scale_inv}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"weight_block_size": list(BLOCK)}}))
    kept = dict(iter_checkpoint(tmp_path, keep_fp8=True))
    assert kept[name].dtype == torch.float8_e4m3fn and torch.equal(kept[name].view(torch.uint8), quantised.view(torch.uint8))
    assert torch.equal(kept[name + "_scale_inv"], scale_inv)
    torch.testing.assert_close(dict(iter_checkpoint(tmp_path))[name], dequantised)


def test_replicated_layer_computes_the_dequantised_product():
    """The FP8 layer's output equals x @ dequant(weight).T and its parameters stay e4m3 + fp32 scales."""
    _, _, dequantised = _weights()
    layer = _layer("replicated")
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale_inv.shape == (4, 6)
    x = torch.randn(5, IN)
    torch.testing.assert_close(layer(x), x @ dequantised.T, rtol=1e-5, atol=1e-5)


def test_two_rank_shards_reassemble_the_full_product():
    """Column-parallel shards concatenate, row-parallel partial sums add up, to the unsharded product."""
    _, _, dequantised = _weights()
    x = torch.randn(3, IN)
    expected = x @ dequantised.T
    columns = [_layer("column", rank, 2)(x) for rank in range(2)]
    torch.testing.assert_close(torch.cat(columns, dim=1), expected, rtol=1e-5, atol=1e-5)
    partial = [_layer("row", rank, 2, reduce=False)(x[:, rank * IN // 2 : (rank + 1) * IN // 2]) for rank in range(2)]
    torch.testing.assert_close(partial[0] + partial[1], expected, rtol=1e-5, atol=1e-5)


def test_block_splitting_shards_and_bad_shapes_are_refused():
    """A TP split that starts inside a quantisation block, an unknown parallel kind, or a weight of the
    wrong shape is a ValueError naming the problem."""
    quantised, scale_inv, _ = _weights()
    with pytest.raises(ValueError, match="quantisation block"):
        shard_block_scale(scale_inv, 24, 48, 0, 16)
    layer = Fp8Linear(IN, 48, TPGroup(1, 2), "column", (32, 16))  # rank 1 starts at row 24
    with pytest.raises(ValueError, match="quantisation block"):
        layer.load_full(*quantize_fp8_block(torch.randn(48, IN), (32, 16)))
    with pytest.raises(ValueError, match="does not match"):
        _layer("replicated").load_full(quantised[:32], scale_inv[:2])
    with pytest.raises(ValueError, match="parallel"):
        Fp8Linear(IN, OUT, TPGroup(), "diagonal")


def _fp8_checkpoint(tiny_checkpoint, tmp_path: Path) -> Path:
    """The tiny "yarn" checkpoint with its 2-D linear weights stored FP8 (block scales), as DeepSeek-V3 ships."""
    import shutil

    from engine.model_configs.model_config import ModelConfig

    source = tiny_checkpoint("yarn")
    config = ModelConfig.from_pretrained(source)
    tensors = dict(iter_checkpoint(source, config.num_hidden_layers))
    stored = {}
    for name, tensor in tensors.items():
        if tensor.dim() == 2 and not any(part in name for part in ("embed_tokens", "lm_head", ".gate.")):
            stored[name], stored[name + "_scale_inv"] = quantize_fp8_block(tensor, BLOCK)
        else:
            stored[name] = tensor
    checkpoint = tmp_path / "fp8"
    checkpoint.mkdir()
    save_file({name: tensor.contiguous() for name, tensor in stored.items()}, str(checkpoint / "model.safetensors"))
    hf_config = json.loads((source / "config.json").read_text())
    hf_config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(BLOCK)}
    (checkpoint / "config.json").write_text(json.dumps(hf_config))
    for extra in source.glob("tokenizer*"):
        shutil.copy(extra, checkpoint / extra.name)
    return checkpoint


def test_fp8_checkpoint_kept_fp8_runs_like_the_dequantised_model(tiny_checkpoint, tmp_path: Path):
    """load_model(keep_fp8=True) on an FP8 checkpoint holds its linears as Fp8Linear and its routed experts
    as e4m3 + block scales (kv_b_proj dequantised: MLA absorbs it), and gives the logits of the same
    checkpoint dequantised on load (the CPU path)."""
    from engine.attention.torch_backend import TorchAttentionBackend
    from engine.model_configs.model_config import ModelConfig
    from engine.runtime.forward_batch import ForwardMode
    from engine.layers.linear import ColumnParallelLinear
    from engine.models.deepseek_v3 import load_model
    from tests.engine.tiny_models import PagedRunner

    checkpoint = _fp8_checkpoint(tiny_checkpoint, tmp_path)
    config = ModelConfig.from_pretrained(checkpoint)
    _, kept = load_model(checkpoint, TPGroup(), TorchAttentionBackend(), torch.float32, keep_fp8=True)
    _, dequantised = load_model(checkpoint, TPGroup(), TorchAttentionBackend(), torch.float32)
    layer = kept.model.layers[config.num_hidden_layers - 1]
    assert isinstance(layer.self_attn.o_proj, Fp8Linear) and isinstance(layer.mlp.shared_experts.gate_proj, Fp8Linear)
    assert type(layer.self_attn.kv_b_proj) is ColumnParallelLinear
    assert layer.mlp.experts.gate_up_proj.dtype == torch.float8_e4m3fn
    assert not any(isinstance(module, Fp8Linear) for module in dequantised.modules())
    tokens = [(5 * i) % config.vocab_size for i in range(19)]
    logits_kept, _ = PagedRunner(kept, config).step(ForwardMode.EXTEND, [(0, tokens)])
    logits_plain, _ = PagedRunner(dequantised, config).step(ForwardMode.EXTEND, [(0, tokens)])
    torch.testing.assert_close(logits_kept, logits_plain, rtol=1e-4, atol=1e-4)


def test_fp8_model_is_built_on_meta_and_never_allocated_in_the_model_dtype(tiny_checkpoint, tmp_path: Path,
                                                                          monkeypatch):
    """load_model(keep_fp8=True) constructs the model on the meta device (so the model-dtype copy of the FP8
    weights, ~163 GB of DeepSeek-V3's routed experts per rank at TP8, is never allocated) and ends with every
    tensor on the target device, RoPE's inv_freq computed again equal to a plain build's."""
    from engine.attention.torch_backend import TorchAttentionBackend
    from engine.models import deepseek_v3

    built_on: list[str] = []
    original_init = deepseek_v3.DeepseekV3ForCausalLM.__init__

    def recording_init(self, *args, **kwargs):
        built_on.append(torch.empty(0).device.type)
        original_init(self, *args, **kwargs)

    monkeypatch.setattr(deepseek_v3.DeepseekV3ForCausalLM, "__init__", recording_init)
    checkpoint = _fp8_checkpoint(tiny_checkpoint, tmp_path)
    _, kept = deepseek_v3.load_model(checkpoint, TPGroup(), TorchAttentionBackend(), torch.float32, keep_fp8=True)
    _, plain = deepseek_v3.load_model(checkpoint, TPGroup(), TorchAttentionBackend(), torch.float32)
    assert built_on == ["meta", "cpu"]
    tensors = [*kept.named_parameters(), *kept.named_buffers()]
    assert all(tensor.device.type == "cpu" for _, tensor in tensors), [n for n, t in tensors if t.is_meta][:5]
    for name, buffer in plain.named_buffers():
        if name.endswith("inv_freq"):
            torch.testing.assert_close(kept.get_buffer(name), buffer)


def test_device_importer_builds_the_fp8_form_the_exporter_shares(tiny_checkpoint, tmp_path: Path):
    """The model an IPC importer builds for a GPU (registry.build_model(device="cuda"): no weights, meta
    device) has exactly the tensor names, shapes and dtypes of the FP8 model the exporter loaded, so binding
    the exporter's manifest succeeds instead of falling back to a private copy."""
    from engine.attention.torch_backend import TorchAttentionBackend
    from engine.model_configs.model_config import ModelConfig
    from engine.models.deepseek_v3 import load_model
    from engine.models.registry import build_model
    from engine.weights.weight_store import _named_tensors

    checkpoint = _fp8_checkpoint(tiny_checkpoint, tmp_path)
    config = ModelConfig.from_pretrained(checkpoint)
    _, exported = load_model(checkpoint, TPGroup(), TorchAttentionBackend(), torch.float32, keep_fp8=True)
    built = build_model(checkpoint, config, TPGroup(), TorchAttentionBackend(), torch.float32, device="cuda")
    described = {name: (tuple(t.shape), t.dtype) for name, t in _named_tensors(built) if t.numel()}
    expected = {name: (tuple(t.shape), t.dtype) for name, t in _named_tensors(exported) if t.numel()}
    assert {name for name, _ in _named_tensors(built)} == {name for name, _ in _named_tensors(exported)}
    assert described == {name: value for name, value in expected.items() if name in described}
    assert any(dtype == torch.float8_e4m3fn for _, dtype in described.values())
    assert all(t.is_meta for _, t in _named_tensors(built))  # nothing allocated before binding
