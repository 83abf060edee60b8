"""Kimi K3 in the engine against the token-by-token float64 reference (tests/engine/k3_reference.py) on tiny
checkpoints in K3's on-disk layout: logits within 1e-4 (float32), chunked prefill (1, 7, 64) and decode
giving the same logits and KDA state, unquantised (bf16 / fp32) routed experts beside MXFP4 ones, and one clear
ValueError for bad checkpoints and configs (a half-quantised one included)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.attention.torch_backend import TorchAttentionBackend
from engine.runtime.distributed import TPGroup
from engine.runtime.forward_batch import ForwardMode
from engine.models.kimi_k3 import KimiK3ForCausalLM, load_model
from engine.layers.dense_experts import DenseExperts
from tests.engine.k3_checkpoint import EXPERT_DTYPES, k3_config, k3_state_dict, make_k3_checkpoint, write_k3_checkpoint
from tests.engine.k3_reference import K3Reference
from tests.engine.k3_runner import HybridRunner

TOL = 1e-4
MLA_ONLY = dict(linear_attn_config={"kda_layers": [], "full_attn_layers": list(range(1, 9))})
VARIANTS = {
    "hybrid": {},  # 6 KDA + 2 MLA layers (0-idx 3 and 7), K3 safe gate, full-rank output gate
    "mla_only": MLA_ONLY,
    "kimi_gate": dict(linear_attn_config={"gate_lower_bound": None, "use_full_rank_gate": False},
                      latent_moe_use_norm=False, attn_res_block_size=4),
}


@pytest.fixture(scope="module")
def k3_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("k3")
    return {name: make_k3_checkpoint(root, name, 0, **over) for name, over in VARIANTS.items()}


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _model(path: Path) -> KimiK3ForCausalLM:
    return load_model(path, TPGroup(), TorchAttentionBackend(), torch.float32)[1]


@pytest.mark.parametrize("variant", [  # the float64 reference costs ~2 s of CPU a variant: hybrid in the fast loop
    pytest.param(name, marks=() if name == "hybrid" else pytest.mark.slow) for name in VARIANTS])
def test_engine_matches_reference(k3_dirs: dict[str, Path], variant: str) -> None:
    """Prefill, a decode step and a continuation chunk give the reference logits within 1e-4, for two
    sequences batched together (different lengths)."""
    config = k3_config(**VARIANTS[variant])
    reference = K3Reference(config, k3_state_dict(config, 0))
    other = K3Reference(config, k3_state_dict(config, 0))
    tokens, tokens2 = _tokens(20, 1), _tokens(9, 2)
    expected = reference.run(tokens)
    expected2 = other.run(tokens2)
    runner = HybridRunner(_model(k3_dirs[variant]))
    first, _ = runner.step(ForwardMode.EXTEND, [(0, tokens[:12]), (1, tokens2[:8])])
    step, _ = runner.step(ForwardMode.DECODE, [(0, tokens[12:13]), (1, tokens2[8:9])])
    rest, _ = runner.step(ForwardMode.EXTEND, [(0, tokens[13:])])
    torch.testing.assert_close(first[:12].double(), expected[:12], atol=TOL, rtol=0)
    torch.testing.assert_close(first[12:].double(), expected2[:8], atol=TOL, rtol=0)
    torch.testing.assert_close(step.double(), torch.stack([expected[12], expected2[8]]), atol=TOL, rtol=0)
    torch.testing.assert_close(rest.double(), expected[13:], atol=TOL, rtol=0)


@pytest.mark.parametrize("experts", ["bf16", "fp32"])
def test_unquantised_experts_match_reference(tmp_path: Path, experts: str) -> None:
    """A checkpoint without quantization_config whose routed experts are plain w1/w2/w3 weights (bf16 or
    fp32) loads them unquantised and gives the reference logits within 1e-4 through prefill and decode."""
    config = k3_config(experts)
    state_dict = k3_state_dict(config, 0, EXPERT_DTYPES[experts])
    assert not any("weight_packed" in name for name in state_dict)
    model = _model(_write(tmp_path, config, state_dict))
    moe = model.model.layers[1].mlp
    assert isinstance(moe.experts, DenseExperts) and moe.experts.w13.dtype == torch.float32
    tokens = _tokens(14, 6)
    expected = K3Reference(config, state_dict).run(tokens)
    runner = HybridRunner(model)
    first, _ = runner.step(ForwardMode.EXTEND, [(0, tokens[:12])])
    steps = [runner.step(ForwardMode.DECODE, [(0, [token])])[0] for token in tokens[12:]]
    torch.testing.assert_close(torch.cat([first, *steps]).double(), expected, atol=TOL, rtol=0)


def _chunked(model: KimiK3ForCausalLM, tokens: list[int], chunk: int) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    runner = HybridRunner(model, num_pages=32)
    logits = [runner.step(ForwardMode.EXTEND, [(0, tokens[i : i + chunk])])[0] for i in range(0, len(tokens), chunk)]
    return torch.cat(logits), runner.state_of(0)


@pytest.mark.slow  # 92 forward steps (chunks of 1 and 7 over 80 tokens): ~3 s of CPU
def test_prefill_chunk_sizes_agree(k3_dirs: dict[str, Path]) -> None:
    """Prefill in chunks of 1, 7 and 64 tokens gives the same logits (1e-4) and the same final KDA state."""
    model = _model(k3_dirs["hybrid"])
    tokens = _tokens(80, 3)
    base_logits, (base_conv, base_rec) = _chunked(model, tokens, 64)
    for chunk in (1, 7):
        logits, (conv, rec) = _chunked(model, tokens, chunk)
        torch.testing.assert_close(logits, base_logits, atol=TOL, rtol=0, msg=f"chunk {chunk}")
        torch.testing.assert_close(conv, base_conv, atol=TOL, rtol=0, msg=f"conv state, chunk {chunk}")
        torch.testing.assert_close(rec, base_rec, atol=TOL, rtol=0, msg=f"recurrent state, chunk {chunk}")
    assert base_rec.abs().sum() > 0 and base_conv.abs().sum() > 0


@pytest.mark.parametrize("variant", ["hybrid", "mla_only"])
def test_decode_equals_prefill_at_every_position(k3_dirs: dict[str, Path], variant: str) -> None:
    """Decoding one token at a time (absorbed MLA, recurrent KDA) gives the prefill logits at every position."""
    model = _model(k3_dirs[variant])
    tokens = _tokens(24, 4)
    prefill, _ = HybridRunner(model).step(ForwardMode.EXTEND, [(0, tokens)])
    runner = HybridRunner(model)
    first, _ = runner.step(ForwardMode.EXTEND, [(0, tokens[:1])])
    steps = [runner.step(ForwardMode.DECODE, [(0, [t])])[0] for t in tokens[1:]]
    torch.testing.assert_close(torch.cat([first, *steps]), prefill, atol=TOL, rtol=0)


def test_experts_stay_packed(k3_dirs: dict[str, Path]) -> None:
    """Routed experts are resident as uint8 MXFP4 (packed + scale), not as float weights."""
    model = _model(k3_dirs["mla_only"])
    moe = model.model.layers[1].mlp
    assert moe.experts.w13_packed.dtype == torch.uint8 and moe.experts.w2_scale.dtype == torch.uint8
    assert moe.experts.resident_bytes / moe.experts.bf16_bytes() <= 0.30
    assert not any(".experts." in name for name, _ in model.named_parameters())


def test_capture_is_next_consumers_mix(k3_dirs: dict[str, Path]) -> None:
    """A captured layer is the pre-norm Agg the next layer's attention reads: normed it equals that layer's input."""
    model = _model(k3_dirs["mla_only"])
    tokens = _tokens(6, 5)
    _, out = HybridRunner(model).step(ForwardMode.EXTEND, [(0, tokens)], capture_layers=(2, 7))
    assert out.captured[0].shape == (6, 64) and out.captured[1].shape == (6, 64)
    torch.testing.assert_close(model.model.norm(out.captured[1]), out.hidden)


def test_capture_changes_no_output(k3_dirs: dict[str, Path]) -> None:
    """The next consumer takes a captured tap as its Agg instead of mixing the stream again: the hidden states of a
    forward that captures are bit-identical to one that does not, prefill and decode, the last layer included."""
    model = _model(k3_dirs["mla_only"])
    tokens = _tokens(6, 5)
    plain, capturing = HybridRunner(model), HybridRunner(model)
    last = len(model.model.layers) - 1
    for mode, chunk in ((ForwardMode.EXTEND, tokens[:5]), (ForwardMode.DECODE, tokens[5:])):
        expected, _ = plain.step(mode, [(0, chunk)])
        got, out = capturing.step(mode, [(0, chunk)], capture_layers=(1, last))
        assert torch.equal(got, expected), mode
        assert len(out.captured) == 2


# ---- bad input ----

def _write(tmp_path: Path, config: dict, state_dict: dict[str, torch.Tensor]) -> Path:
    return write_k3_checkpoint(tmp_path / "bad", config, state_dict)


def test_missing_mxfp4_scale_is_named(tmp_path: Path) -> None:
    """A routed expert without its weight_scale: ValueError naming that tensor."""
    config = k3_config(**MLA_ONLY)
    sd = k3_state_dict(config, 0)
    name = "language_model.model.layers.2.block_sparse_moe.experts.5.w3.weight_scale"
    del sd[name]
    with pytest.raises(ValueError, match="missing: " + name.replace(".", r"\.")):
        _model(_write(tmp_path, config, sd))


def test_float_packed_weight_is_named(tmp_path: Path) -> None:
    """An MXFP4 weight_packed stored as float: ValueError naming it and its dtype."""
    config = k3_config(**MLA_ONLY)
    sd = k3_state_dict(config, 0)
    name = "language_model.model.layers.1.block_sparse_moe.experts.0.w2.weight_packed"
    sd[name] = sd[name].float()
    with pytest.raises(ValueError, match=r"experts\.0\.w2\.weight_packed dtype torch.float32"):
        _model(_write(tmp_path, config, sd))


def test_half_quantised_checkpoints_are_refused_naming_the_tensor(tmp_path: Path) -> None:
    """An unquantised expert in an MXFP4 checkpoint, and an MXFP4 expert in an unquantised one: a ValueError
    naming the odd tensor and saying what the config declares."""
    config = k3_config(**MLA_ONLY)
    sd = k3_state_dict(config, 0)
    name = "language_model.model.layers.2.block_sparse_moe.experts.5.w1"
    del sd[name + ".weight_packed"], sd[name + ".weight_scale"]
    sd[name + ".weight"] = torch.zeros(32, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=name.replace(".", r"\.") + r"\.weight is unquantised, but "
                                         "quantization_config says the routed experts are MXFP4"):
        _model(_write(tmp_path / "mxfp4", config, sd))
    plain = k3_config("bf16", **MLA_ONLY)
    sd = k3_state_dict(plain, 0, torch.bfloat16)
    packed = k3_state_dict(config, 0)
    del sd[name + ".weight"]
    sd[name + ".weight_packed"], sd[name + ".weight_scale"] = packed[name + ".weight_packed"], packed[name + ".weight_scale"]
    with pytest.raises(ValueError, match=name.replace(".", r"\.") + r"\.weight_(packed|scale) is MXFP4, but "
                                         "config.json has no quantization_config"):
        _model(_write(tmp_path / "plain", plain, sd))


def test_layer_kinds_disagreeing_with_tensors(tmp_path: Path) -> None:
    """config.json says layer 3 (0-idx) is MLA but the tensors are KDA's: one ValueError naming both sides."""
    tensors_config = k3_config()
    sd = k3_state_dict(tensors_config, 0)
    config = k3_config(**MLA_ONLY)
    with pytest.raises(ValueError) as err:
        _model(_write(tmp_path, config, sd))
    message = str(err.value)
    assert "missing" in message and "layers.0.self_attn.q_a_proj.weight" in message
    assert "unexpected" in message and "layers.0.self_attn.q_conv1d.weight" in message


def test_inconsistent_layer_lists(tmp_path: Path) -> None:
    """A layer in neither kda_layers nor full_attn_layers: ValueError naming the field."""
    config = k3_config(linear_attn_config={"kda_layers": [1, 2, 3, 5, 6], "full_attn_layers": [4, 8]})
    with pytest.raises(ValueError, match="kda_layers|full_attn_layers"):
        _model(_write(tmp_path, config, k3_state_dict(k3_config(), 0)))


def test_heads_not_divisible_by_tp(k3_dirs: dict[str, Path]) -> None:
    """24 heads over 5 ranks: ValueError naming num_attention_heads and the KDA head count."""
    with pytest.raises(ValueError, match="num_attention_heads") as err:
        load_model(k3_dirs["mla_only"], TPGroup(0, 5), TorchAttentionBackend(), torch.float32)
    assert "linear_attn_config.num_heads" in str(err.value)
