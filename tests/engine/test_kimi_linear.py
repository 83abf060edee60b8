"""Kimi Linear in the engine against transformers' KimiLinearForCausalLM, and the per-sequence state:
chunked prefill, decode vs prefill, batches mixing sequences at different points, weight errors."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.attention.torch_backend import TorchAttentionBackend
from engine.runtime.distributed import TPGroup
from engine.runtime.forward_batch import ForwardMode
from engine.models.kimi_linear import load_model
from tests.engine.kimi_linear_models import KIMI_VARIANTS, StatefulRunner, hf_logits, make_kimi_checkpoint

TOL = 1e-4


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("kimi")
    return lambda variant: make_kimi_checkpoint(root, variant)


def _prompt(vocab: int, length: int, seed: int = 0) -> list[int]:
    return torch.randint(3, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _runner(model_dir: Path) -> tuple[StatefulRunner, list[int]]:
    config, model = load_model(model_dir, TPGroup(), TorchAttentionBackend(), torch.float32)
    return StatefulRunner(model, config), _prompt(config.vocab_size, 150)


@pytest.mark.parametrize("variant", KIMI_VARIANTS)
def test_logits_match_transformers(kimi_dir, variant):
    """Prefill logits of a 150-token prompt (3 KDA chunks) are within 1e-4 of transformers' in float32."""
    runner, prompt = _runner(kimi_dir(variant))
    got, _ = runner.step(ForwardMode.EXTEND, [(0, prompt)])
    torch.testing.assert_close(got, hf_logits(kimi_dir(variant), prompt), atol=TOL, rtol=0)


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_prefill_equals_one_shot(kimi_dir, chunk):
    """Prefill in chunks of 1, 7 or 64 tokens gives the one-shot logits and the same final state."""
    whole, prompt = _runner(kimi_dir("q_lora"))
    prompt = prompt[:70]
    expected, _ = whole.step(ForwardMode.EXTEND, [(0, prompt)])
    pieces, _ = _runner(kimi_dir("q_lora"))
    got = torch.cat([pieces.step(ForwardMode.EXTEND, [(0, prompt[i : i + chunk])])[0]
                     for i in range(0, len(prompt), chunk)])
    torch.testing.assert_close(got, expected, atol=TOL, rtol=0)
    for a, b in zip(pieces.state_of(0), whole.state_of(0)):
        torch.testing.assert_close(a, b, atol=TOL, rtol=0)


def test_decode_equals_prefill_at_every_position(kimi_dir):
    """After a 5-token prefill, one DECODE step per token gives the prefill logits at every position."""
    prefill, prompt = _runner(kimi_dir("base"))
    prompt = prompt[:40]
    expected, _ = prefill.step(ForwardMode.EXTEND, [(0, prompt)])
    decode, _ = _runner(kimi_dir("base"))
    rows = [decode.step(ForwardMode.EXTEND, [(0, prompt[:5])])[0]]
    rows += [decode.step(ForwardMode.DECODE, [(0, [token])])[0] for token in prompt[5:]]
    torch.testing.assert_close(torch.cat(rows), expected, atol=TOL, rtol=0)
    for a, b in zip(decode.state_of(0), prefill.state_of(0)):
        torch.testing.assert_close(a, b, atol=TOL, rtol=0)


def test_mixed_batch_equals_alone(kimi_dir):
    """A batch mixing a fresh prefill, a continued prefill chunk and decodes equals each sequence run alone."""
    model_dir = kimi_dir("heads24")
    batched, _ = _runner(model_dir)
    prompts = [_prompt(256, n, seed=s) for s, n in ((1, 30), (2, 20), (3, 12))]
    batched.step(ForwardMode.EXTEND, [(0, prompts[0][:20]), (1, prompts[1][:19])])
    mixed, _ = batched.step(ForwardMode.EXTEND, [(0, prompts[0][20:]), (1, prompts[1][19:]), (2, prompts[2])])
    decoded, _ = batched.step(ForwardMode.DECODE, [(0, [5]), (1, [6]), (2, [7])])
    for seq, (cut, token) in enumerate(((20, 5), (19, 6), (0, 7))):
        alone, _ = _runner(model_dir)
        if cut:
            alone.step(ForwardMode.EXTEND, [(seq, prompts[seq][:cut])])
        rest, _ = alone.step(ForwardMode.EXTEND, [(seq, prompts[seq][cut:])])
        step, _ = alone.step(ForwardMode.DECODE, [(seq, [token])])
        start = sum(len(p[c:]) for p, c in zip(prompts[:seq], (20, 19, 0)))
        torch.testing.assert_close(mixed[start : start + len(rest)], rest, atol=TOL, rtol=0)
        torch.testing.assert_close(decoded[seq : seq + 1], step, atol=TOL, rtol=0)
        for a, b in zip(batched.state_of(seq), alone.state_of(seq)):
            torch.testing.assert_close(a, b, atol=TOL, rtol=0)


def _rewrite(src: Path, dst: Path, edit) -> Path:
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(src / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors")
    return dst


def test_weight_errors_name_tensors(kimi_dir, tmp_path):
    """A missing, a mis-shaped and a layer-kind-swapped tensor are each named in one ValueError."""
    src = kimi_dir("base")

    def edit(t):
        del t["model.layers.0.self_attn.q_conv1d.weight"]
        t["model.layers.1.self_attn.A_log"] = torch.zeros(2)
        t["model.layers.2.self_attn.kv_b_proj.weight"] = torch.zeros(128, 16)  # an MLA tensor in a KDA layer

    with pytest.raises(ValueError) as info:
        load_model(_rewrite(src, tmp_path / "bad", edit), TPGroup(), TorchAttentionBackend(), torch.float32)
    message = str(info.value)
    for name in ("model.layers.0.self_attn.q_conv1d.weight", "model.layers.1.self_attn.A_log",
                 "model.layers.2.self_attn.kv_b_proj.weight"):
        assert name in message
