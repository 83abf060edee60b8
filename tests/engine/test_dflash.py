"""The DFlash draft: config validation, context padding mask, non-causal block, training == inference path."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.models.dflash import (DFlashConfig, DFlashDraft, apply_rope, apply_rope_signed, load_draft, save_draft,
                                 signed_sin)

BASE = dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64,
            target_layer_ids=(0, 2), target_hidden_size=24, block_size=4, mask_token_id=3)


@pytest.fixture
def draft() -> DFlashDraft:
    torch.manual_seed(0)
    model = DFlashDraft(DFlashConfig(**BASE)).eval()
    with torch.no_grad():  # non-trivial norm weights so every parameter matters
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    return model


@pytest.mark.parametrize("field, value", [
    ("hidden_size", 0), ("num_layers", 0), ("num_heads", 3), ("head_dim", 7), ("block_size", 1),
    ("target_layer_ids", ()), ("target_layer_ids", (1, 1)), ("mask_token_id", -1), ("rms_norm_eps", 0.0),
    ("rope_theta", -1.0),
])
def test_config_rejects_bad_field_naming_it(field: str, value: object) -> None:
    """Every invalid field raises ValueError whose message names that field."""
    with pytest.raises(ValueError, match=field):
        DFlashConfig(**{**BASE, field: value})


def test_config_derived_values_and_dict_round_trip() -> None:
    """draft_dim = 2 * kv_heads * head_dim; to_dict/from_dict round-trips; unknown keys are refused."""
    config = DFlashConfig(**BASE)
    assert config.draft_dim == 2 * 2 * 8
    assert DFlashConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match="bogus"):
        DFlashConfig.from_dict({**config.to_dict(), "bogus": 1})
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.block_size = 8  # type: ignore[misc]


def _inputs(draft: DFlashDraft, lens: list[int], lmax: int) -> tuple[torch.Tensor, ...]:
    cfg = draft.config
    s, b = len(lens), cfg.block_size
    captured = torch.randn(s, lmax, cfg.context_input_size)
    context = draft.context_entries(captured, torch.arange(lmax).expand(s, lmax)).detach()
    embeds = torch.randn(s, b, cfg.hidden_size)
    positions = torch.tensor(lens)[:, None] + torch.arange(b)
    return embeds, positions, context, torch.tensor(lens)


def test_context_padding_rows_are_masked(draft: DFlashDraft) -> None:
    """Rows at or beyond context_lens[s] change nothing; a valid row does change the output."""
    embeds, positions, context, lens = _inputs(draft, [3, 6, 9], lmax=9)
    with torch.no_grad():
        reference = draft(embeds, positions, context, lens)
        noisy = context.clone()
        for s, n in enumerate(lens.tolist()):
            noisy[:, s, n:] = torch.randn_like(noisy[:, s, n:]) * 100
        torch.testing.assert_close(draft(embeds, positions, noisy, lens), reference)
        changed = context.clone()
        changed[:, 0, 1] += 1.0
        assert not torch.allclose(draft(embeds, positions, changed, lens)[0], reference[0])


def test_block_is_non_causal(draft: DFlashDraft) -> None:
    """Changing the LAST block token changes the output at block position 0."""
    embeds, positions, context, lens = _inputs(draft, [5], lmax=5)
    with torch.no_grad():
        reference = draft(embeds, positions, context, lens)
        embeds[0, -1] += 1.0
        assert not torch.allclose(draft(embeds, positions, context, lens)[0, 0], reference[0, 0])


def test_training_path_matches_inference_api(draft: DFlashDraft) -> None:
    """forward_anchors (many blocks, masked) == forward over the context before each anchor, padded."""
    torch.manual_seed(1)
    n, t, b = 2, 20, draft.config.block_size
    captured = torch.randn(n, t, draft.config.context_input_size)
    anchors = torch.tensor([[1, 7, 12], [4, 9, 16]])
    embeds = torch.randn(n, anchors.shape[1], b, draft.config.hidden_size)
    with torch.no_grad():
        batched = draft.forward_anchors(captured, embeds, anchors)
        for row in range(n):
            for k, anchor in enumerate(anchors[row].tolist()):
                context = draft.context_entries(captured[row, :anchor], torch.arange(anchor))
                padded = torch.cat((context, torch.randn(context.shape[0], 3, context.shape[2])), dim=1)
                single = draft(embeds[row, k][None], (anchor + torch.arange(b))[None], padded[:, None],
                               torch.tensor([anchor]))
                torch.testing.assert_close(single[0], batched[row, k], rtol=1e-4, atol=1e-5)


def test_save_load_round_trip_and_mismatch(draft: DFlashDraft, tmp_path) -> None:
    """A saved draft reloads to the same function; missing and unexpected tensors are listed by name."""
    save_draft(draft, tmp_path / "d", dtype=torch.float32)
    loaded = load_draft(tmp_path / "d")
    assert loaded.config == draft.config
    embeds, positions, context, lens = _inputs(draft, [4], lmax=6)
    with torch.no_grad():
        torch.testing.assert_close(loaded(embeds, positions, context, lens), draft(embeds, positions, context, lens))
    other = DFlashDraft(DFlashConfig(**{**BASE, "num_layers": 1}))
    save_draft(other, tmp_path / "short", dtype=torch.float32)
    (tmp_path / "short" / "config.json").write_text((tmp_path / "d" / "config.json").read_text())
    with pytest.raises(ValueError, match=r"missing \['layers\.1\."):
        load_draft(tmp_path / "short")


def test_unpadded_context_needs_no_mask_and_fused_weights_follow_writes(draft: DFlashDraft) -> None:
    """full_context (every context row valid) gives the masked path's output; the inference forward's stacked
    q/k/v and gate/up weights equal the separate linears' and are rebuilt after a weight is written."""
    embeds, positions, context, lens = _inputs(draft, [6], lmax=6)
    with torch.no_grad():
        masked = draft(embeds, positions, context, lens)
        torch.testing.assert_close(draft(embeds, positions, context, lens, full_context=True), masked)
        draft.layers[0].up_proj.weight.mul_(2.0)
        changed = draft(embeds, positions, context, lens, full_context=True)
    with torch.enable_grad():
        unfused = draft(embeds, positions, context, lens)  # autograd on: the separate linears
    torch.testing.assert_close(changed, unfused.detach())
    assert not torch.allclose(changed, masked)


def test_fused_context_entries_equal_the_per_layer_ones(draft: DFlashDraft) -> None:
    """At inference every layer's context entry comes from one fused k/v matmul, one key norm and one RoPE;
    the result equals stacking each layer's context_entry (the training path), for batched positions too."""
    captured = torch.randn(3, 5, 2 * 24)
    positions = torch.arange(5).expand(3, 5) + torch.tensor([[0], [7], [30]])
    with torch.no_grad():
        feature = draft.context_norm(draft.fc(captured))
        cos, sin = draft._rope(positions, feature.dtype)
        per_layer = torch.stack([layer.context_entry(feature, cos, sin) for layer in draft.layers])
        fused = draft._fused_context_entries(feature, cos, sin)
        assert fused is not None
        torch.testing.assert_close(fused, per_layer, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(draft.context_entries(captured, positions), per_layer, rtol=1e-6, atol=1e-6)
    assert draft._fused_context_entries(feature, cos, sin) is None  # grad enabled: the training path


def test_fused_query_key_norm_and_rope_are_bit_identical(draft: DFlashDraft) -> None:
    """At inference each layer's queries and keys get ONE rms_norm (stacked q_norm / k_norm weights) and ONE RoPE
    (apply_rope_signed, with the signed sin table computed once per forward): the draft's output is bit-identical
    to the per-module path (autograd on), masked and unmasked, and apply_rope_signed equals apply_rope."""
    x = torch.randn(2, 5, 3, 8)
    cos, sin = torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    assert torch.equal(apply_rope_signed(x, cos, signed_sin(sin)), apply_rope(x, cos, sin))
    embeds, positions, context, lens = _inputs(draft, [6, 3], lmax=6)
    with torch.no_grad():
        fused = draft(embeds, positions, context, lens)
        fused_full = draft(embeds, positions, context, torch.tensor([6, 6]), full_context=True)
    assert all("_qk_norm_weight" in layer.__dict__ for layer in draft.layers)  # the fused path ran
    with torch.enable_grad():
        plain = draft(embeds, positions, context, lens).detach()
        plain_full = draft(embeds, positions, context, torch.tensor([6, 6]), full_context=True).detach()
    assert torch.equal(fused, plain) and torch.equal(fused_full, plain_full)
