"""The DSpark draft: published config and tensor layout, YaRN RoPE, the Markov head applied left to right,
the confidence head, and the engine picking DSpark vs DFlash from the draft's config."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.spec import spec_decode
from engine.models.dflash import DFlashDraft, load_draft
from engine.models.draft_registry import load_any_draft, read_any_draft_config
from engine.models.dspark import DSparkDraft, load_dspark
from engine.models.dspark_config import DSparkConfig
from tests.engine.dspark_fixtures import add_random_dspark
from tests.engine.k3_checkpoint import make_k3_checkpoint
from tests.engine.spec_fixtures import add_random_draft


@pytest.fixture(scope="module")
def k3_dir(tmp_path_factory):
    return make_k3_checkpoint(tmp_path_factory.mktemp("dspark"), "k3")


@pytest.fixture()
def dspark_dir(k3_dir, tmp_path):
    target = tmp_path / "k3"
    target.mkdir()
    (target / "config.json").write_text((k3_dir / "config.json").read_text())
    return add_random_dspark(target, gamma=7, seed=1)


def test_published_tensor_names_and_roundtrip(dspark_dir):
    """The saved draft uses the published names (self_attn.*, mlp.*, hidden_norm, markov_head, confidence_head,
    fp32 confidence head) and loads back to the same function."""
    names = set(load_file(str(dspark_dir / "model.safetensors")))
    for expected in ("layers.0.self_attn.q_proj.weight", "layers.1.self_attn.k_norm.weight",
                     "layers.0.mlp.gate_proj.weight", "layers.1.input_layernorm.weight",
                     "layers.0.post_attention_layernorm.weight", "fc.weight", "hidden_norm.weight", "norm.weight",
                     "markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.weight",
                     "confidence_head.proj.bias"):
        assert expected in names
    draft = load_dspark(dspark_dir)
    assert isinstance(draft, DSparkDraft) and draft.confidence_head is not None
    assert draft.confidence_head.proj.weight.dtype == torch.float32
    again = load_any_draft(dspark_dir, torch.float32, "cpu")
    embeds, positions = torch.randn(2, 3, 64), torch.arange(3).expand(2, 3) + 5
    captured = torch.randn(2, 5, 3 * 64)
    context = draft.context_entries(captured, torch.arange(5).expand(2, 5)).contiguous()
    lens = torch.tensor([5, 3])
    assert torch.equal(draft(embeds, positions, context, lens), again(embeds, positions, context, lens))


def test_missing_tensor_is_named(dspark_dir):
    """A checkpoint without one tensor is refused with a ValueError naming it (published name)."""
    tensors = load_file(str(dspark_dir / "model.safetensors"))
    del tensors["layers.1.self_attn.k_norm.weight"]
    save_file(tensors, str(dspark_dir / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing tensors \['layers\.1\.self_attn\.k_norm\.weight'\]"):
        load_dspark(dspark_dir)


def test_wrong_shape_and_unexpected_are_named(dspark_dir):
    tensors = load_file(str(dspark_dir / "model.safetensors"))
    tensors["fc.weight"] = tensors["fc.weight"][:, :-1].contiguous()
    tensors["layers.0.self_attn.extra.weight"] = torch.zeros(1)
    save_file(tensors, str(dspark_dir / "model.safetensors"))
    with pytest.raises(ValueError, match=r"fc\.weight \(64, 191\) != \(64, 192\)") as info:
        load_dspark(dspark_dir)
    assert "layers.0.self_attn.extra.weight" in str(info.value) or "layers.0.extra.weight" in str(info.value)


def test_config_keys_nested_and_refusals(dspark_dir):
    """Draft keys are read at top level or under dflash_config; gamma -> verify block gamma + 1; YaRN parsed;
    an unsupported Markov kind and a missing key are refused by name."""
    data = json.loads((dspark_dir / "config.json").read_text())
    nested = {k: v for k, v in data.items() if k not in ("target_layer_ids", "mask_token_id")}
    nested["dflash_config"] = {"target_layer_ids": data["target_layer_ids"], "mask_token_id": data["mask_token_id"]}
    config = DSparkConfig.from_dict(nested)
    assert config.target_layer_ids == (1, 3, 5) and config.block_size == 7 and config.verify_block_size == 8
    assert config.rope.rope_type == "yarn" and config.rope.factor == 4.0
    assert isinstance(read_any_draft_config(dspark_dir), DSparkConfig)
    with pytest.raises(ValueError, match="markov_head_type 'lstm'"):
        DSparkConfig.from_dict({**data, "markov_head_type": "lstm"})
    with pytest.raises(ValueError, match="markov_rank"):
        DSparkConfig.from_dict({k: v for k, v in data.items() if k != "markov_rank"})


def test_yarn_rope_differs_from_default(dspark_dir):
    """The draft's RoPE uses YaRN frequencies and cos/sin scaling when configured."""
    draft = load_dspark(dspark_dir)
    plain = DFlashDraft(draft.config.backbone)
    assert not torch.allclose(draft.inv_freq.float(), plain.inv_freq.float())
    assert draft.rope_scale > 1.0
    cos, _ = draft._rope(torch.tensor([0]), torch.float32)
    assert torch.allclose(cos, torch.full_like(cos, draft.rope_scale))


def test_markov_drafts_left_to_right():
    """Greedy Markov formation: d_{k+1} = argmax(base_k + bias(d_k)), prev_0 = the bonus token."""
    torch.manual_seed(0)
    vocab, n, k = 11, 3, 5
    base, table = torch.randn(n, k, vocab), torch.randn(vocab, vocab) * 3
    markov = lambda prev: table[prev]  # noqa: E731
    tokens, rows = spec_decode._markov_drafts(base, [1, 4, 7], markov, lambda r: (r.argmax(-1), None))
    for i, bonus in enumerate([1, 4, 7]):
        prev = bonus
        for j in range(k):
            expected = base[i, j] + table[prev]
            assert torch.equal(rows[i, j], expected)
            prev = int(expected.argmax())
            assert int(tokens[i, j]) == prev


def test_confidence_head_range(dspark_dir):
    draft = load_dspark(dspark_dir)
    c = draft.confidence(torch.randn(4, 64), torch.tensor([0, 5, 9, 300]))
    assert c.shape == (4,) and bool(((c > 0) & (c < 1)).all())
    no_head = load_dspark(dspark_dir)
    no_head.confidence_head = None
    with pytest.raises(ValueError, match="no confidence head"):
        no_head.confidence(torch.randn(1, 64), torch.tensor([0]))


def test_dflash_drafts_still_load_as_dflash(tmp_path):
    """A DFlash draft directory still loads as DFlash (registry dispatch on model_type)."""
    from tests.engine.tiny_models import make_tiny_checkpoint

    model_dir = make_tiny_checkpoint(tmp_path / "m", "heads24")
    draft_dir = add_random_draft(model_dir, block_size=4)
    draft = load_any_draft(draft_dir, torch.float32, "cpu")
    assert type(draft) is DFlashDraft and not draft.shifted_block
    assert read_any_draft_config(draft_dir).verify_block_size == 4
    reference = load_draft(draft_dir)
    assert all(torch.equal(a, b) for a, b in zip(draft.state_dict().values(), reference.state_dict().values()))
