"""The KDA layer decodes a batch of sequences in one call (no per-sequence loop): each sequence's output and
its state slot come out as if it had run alone (a batch of one), within float32 rounding.

Invariants checked, at batch sizes 1, 3 and 8 with scattered, unordered state slots:
- a plain decode step (one token each, the uniform path) writes each slot's conv window and recurrent state
  and returns each sequence's output as its own one-sequence call does;
- a speculative verify step (snapshot_state, blocks of B tokens, uniform and with clipped blocks of different
  lengths) leaves the slots untouched and fills the snapshot scratch row i with sequence i's states, as the
  one-sequence calls do;
- several steps in a row keep agreeing (the batched path continues from what it wrote)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.runtime.distributed import TPGroup
from engine.runtime.forward_batch import ForwardBatch, ForwardMode, build_attention_metadata
from engine.layers.kda import KimiDeltaAttention
from engine.model_configs.kimi_linear import KimiLinearConfig
from engine.cache.state_pool import StatePool
from tests.engine.k3_checkpoint import k3_config

HIDDEN, HEADS, HEAD_DIM, SLOTS = 64, 4, 16, 12
TEXT = dict(hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
            linear_attn_config={"kda_layers": [1], "full_attn_layers": [2], "num_heads": HEADS, "head_dim": HEAD_DIM})


def _layer(seed: int) -> tuple[KimiDeltaAttention, KimiLinearConfig]:
    config = KimiLinearConfig.from_hf_dict(k3_config(**TEXT))
    layer = KimiDeltaAttention(config, layer_index=0, kda_index=0, tp=TPGroup(), dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in layer.named_parameters():
            scale = 0.3 if "conv" in name or "A_log" in name or "bias" in name else param.shape[-1] ** -0.5
            param.copy_(torch.randn(param.shape, generator=gen) * scale + (1.0 if "o_norm" in name else 0.0))
    return layer.eval(), config


def _cache(config: KimiLinearConfig, seed: int) -> SimpleNamespace:
    """A state pool whose every slot holds a different random (nonzero) state."""
    pool = StatePool(config.state_shape(1, SLOTS, torch.float32))
    gen = torch.Generator().manual_seed(seed)
    pool.conv.copy_(torch.randn(pool.conv.shape, generator=gen))
    pool.recurrent.copy_(0.1 * torch.randn(pool.recurrent.shape, generator=gen))
    return SimpleNamespace(state=pool)


def _batch(slots: list[int], lengths: list[int], snapshot: bool) -> ForwardBatch:
    tokens = sum(lengths)
    metadata = build_attention_metadata(lengths, [8 + n for n in lengths], [[1] for _ in lengths], 64)
    return ForwardBatch(ForwardMode.DECODE, torch.zeros(tokens, dtype=torch.long), torch.zeros(tokens, dtype=torch.long),
                        metadata, state_slots=torch.tensor(slots), snapshot_state=snapshot,
                        state_slots_cpu=tuple(slots))


def _run(layer: KimiDeltaAttention, cache: SimpleNamespace, x: torch.Tensor, slots: list[int], lengths: list[int],
         snapshot: bool) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """One forward; returns the output and, when snapshotting, each row's (conv, recurrent) snapshots."""
    if snapshot:
        cache.state.begin_snapshots(len(slots), max(lengths))
    with torch.no_grad():
        out = layer(x, _batch(slots, lengths, snapshot), cache)
    snaps = []
    if snapshot:
        for row, length in enumerate(lengths):
            snaps.append((cache.state.snapshot_conv[0, row, :length].clone(),
                          cache.state.snapshot_recurrent[0, row, :length].clone()))
    return out, snaps


def _one_by_one(layer, cache, x, slots, lengths, snapshot):
    outs, snaps, start = [], [], 0
    for slot, length in zip(slots, lengths):
        out, snap = _run(layer, cache, x[start : start + length], [slot], [length], snapshot)
        outs.append(out)
        snaps += snap
        start += length
    return torch.cat(outs), snaps


def _slots(batch_size: int) -> list[int]:
    """Scattered and out of order (distinct): 11, 3, 7, then 0, 9, 5, 2, 10."""
    return [11, 3, 7, 0, 9, 5, 2, 10][:batch_size]


@pytest.mark.parametrize("batch_size", [1, 3, 8])
@pytest.mark.parametrize("kind", ["decode", "verify", "verify_clipped"])
def test_batched_step_equals_one_sequence_at_a_time(batch_size: int, kind: str) -> None:
    layer, config = _layer(seed=batch_size)
    slots = _slots(batch_size)
    assert len(set(slots)) == batch_size
    if kind == "decode":
        lengths = [1] * batch_size
    elif kind == "verify":
        lengths = [4] * batch_size
    else:  # clipped blocks: different lengths in one verify step (the ragged path)
        lengths = [1 + (i % 4) for i in range(batch_size)]
    snapshot = kind != "decode"
    batched, single = _cache(config, seed=100 + batch_size), _cache(config, seed=100 + batch_size)
    for step in range(3):
        x = torch.randn(sum(lengths), HIDDEN, generator=torch.Generator().manual_seed(step))
        out_b, snaps_b = _run(layer, batched, x, slots, lengths, snapshot)
        out_s, snaps_s = _one_by_one(layer, single, x, slots, lengths, snapshot)
        torch.testing.assert_close(out_b, out_s, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(batched.state.conv, single.state.conv, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(batched.state.recurrent, single.state.recurrent, atol=1e-5, rtol=1e-5)
        assert len(snaps_b) == len(snaps_s) == (batch_size if snapshot else 0)
        for (conv_b, rec_b), (conv_s, rec_s) in zip(snaps_b, snaps_s):
            torch.testing.assert_close(conv_b, conv_s, atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(rec_b, rec_s, atol=1e-5, rtol=1e-5)
    fresh = _cache(config, seed=100 + batch_size)
    if snapshot:  # verify leaves the slots as they were
        assert torch.equal(batched.state.recurrent, fresh.state.recurrent)
    else:  # decode advanced every slot it names, and only those
        others = [s for s in range(SLOTS) if s not in slots]
        assert torch.equal(batched.state.recurrent[:, others], fresh.state.recurrent[:, others])
        assert not torch.equal(batched.state.recurrent[:, slots], fresh.state.recurrent[:, slots])
