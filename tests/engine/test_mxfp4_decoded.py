"""PackedExperts' kept decoded copy (engine/layers/mxfp4.py): the per-expert matmuls run over it when it fits
the cap (PDSERVE_MXFP4_DECODED_MB), with exactly the values of decoding each expert per call, and the same
weights are decoded once, not once per step; above the cap (or at 0) every call decodes its expert."""
from __future__ import annotations

import pytest
import torch

from engine.layers import mxfp4
from engine.layers.mxfp4 import PackedExperts, dequantize_mxfp4, mxfp4_linear

EXPERTS, HIDDEN, INTER = 4, 64, 32


def _experts(seed: int) -> PackedExperts:
    experts = PackedExperts(EXPERTS, HIDDEN, INTER)
    gen = torch.Generator().manual_seed(seed)
    for name in ("w13_packed", "w2_packed"):
        buffer = getattr(experts, name)
        buffer.copy_(torch.randint(0, 256, buffer.shape, dtype=torch.uint8, generator=gen))
    for name in ("w13_scale", "w2_scale"):
        buffer = getattr(experts, name)
        buffer.copy_(torch.randint(120, 130, buffer.shape, dtype=torch.uint8, generator=gen))
    return experts


class _CountingDequantize:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return dequantize_mxfp4(*args, **kwargs)


def test_cached_path_equals_per_call_decode_bit_for_bit(monkeypatch) -> None:
    """gate_up / down over the kept copy give exactly what decoding the expert for the matmul gives."""
    experts = _experts(seed=1)
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(2))
    h = torch.randn(5, INTER, generator=torch.Generator().manual_seed(3))
    assert experts.dequantized() is not None
    cached = [(experts.gate_up(e, x), experts.down(e, h)) for e in range(EXPERTS)]
    for e, (gate_up, down) in enumerate(cached):
        assert torch.equal(gate_up, mxfp4_linear(x, experts.w13_packed[e], experts.w13_scale[e]))
        assert torch.equal(down, mxfp4_linear(h, experts.w2_packed[e], experts.w2_scale[e]))
    monkeypatch.setattr(mxfp4, "DEQUANT_CACHE_MAX_BYTES", 0)  # the cap at 0: every call decodes
    assert experts.dequantized() is None
    for e, (gate_up, down) in enumerate(cached):
        assert torch.equal(experts.gate_up(e, x), gate_up)
        assert torch.equal(experts.down(e, h), down)


def test_weights_are_decoded_once_across_steps(monkeypatch) -> None:
    """Many expert calls (steps) decode the stack once; a later write to a buffer decodes it again once."""
    counter = _CountingDequantize()
    monkeypatch.setattr(mxfp4, "dequantize_mxfp4", counter)
    experts = _experts(seed=4)
    x = torch.randn(2, HIDDEN)
    for _step in range(3):
        for e in range(EXPERTS):
            experts.gate_up(e, x)
    assert counter.calls == 2  # w13 and w2, each decoded once
    experts.w2_packed[1].bitwise_xor_(0x11)
    before = counter.calls
    experts.gate_up(0, x)
    experts.gate_up(1, x)
    assert counter.calls == before + 2
    monkeypatch.setattr(mxfp4, "DEQUANT_CACHE_MAX_BYTES", 0)
    counter.calls = 0
    for e in range(EXPERTS):
        experts.gate_up(e, x)
    assert counter.calls == EXPERTS  # no kept copy: one decode per call


@pytest.mark.parametrize(("value", "expected"), [(None, 64 * 2**20), ("0", 0), ("1.5", int(1.5 * 2**20))])
def test_cap_from_the_environment(value: str | None, expected: int) -> None:
    environ = {} if value is None else {mxfp4.DEQUANT_CACHE_ENV: value}
    assert mxfp4._cache_cap_bytes(environ) == expected


@pytest.mark.parametrize("value", ["lots", "-1", "nan"])
def test_bad_cap_is_named(value: str) -> None:
    with pytest.raises(ValueError, match=mxfp4.DEQUANT_CACHE_ENV):
        mxfp4._cache_cap_bytes({mxfp4.DEQUANT_CACHE_ENV: value})
