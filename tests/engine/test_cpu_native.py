"""engine/kernels/cpu_native.py: the C loops agree with their PyTorch forms to float32 rounding, are
bit-identical across step counts (decode vs verify), handle strided inputs and non-float32 snapshots, stand
aside where they do not apply (autograd, switched off), and the build is cached by content."""
from __future__ import annotations

import pytest
import torch

from engine.kernels import cpu_native
from engine.layers import kda_ops
from engine.models.dspark_markov import MarkovHead
from engine.spec.spec_decode import _markov_drafts

pytestmark = pytest.mark.skipif(cpu_native.library() is None, reason="no C compiler here: the PyTorch paths run")


def _kda_inputs(n: int, t: int, heads: int = 3, kd: int = 8, vd: int = 6, seed: int = 0):
    """q, k, v as views into one projection (v strided, as the KDA layer's unbind gives them)."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(n * t, 3, heads, max(kd, vd), generator=gen)
    q = torch.nn.functional.normalize(qkv[:, 0, :, :kd], dim=-1).reshape(n, t, heads, kd)
    k = torch.nn.functional.normalize(qkv[:, 1, :, :kd], dim=-1).reshape(n, t, heads, kd)
    v = qkv[:, 2, :, :vd].view(n, t, heads, vd)
    g = -torch.rand(n, t, heads, kd, generator=gen) * 2
    beta = torch.rand(n * t, heads, generator=gen).view(n, t, heads)
    state = torch.randn(n, heads, kd, vd, generator=gen)
    return q, k, v, g, beta, state


def _torch_ops(fn, *args):
    cpu_native.ENABLED = False
    try:
        return fn(*args)
    finally:
        cpu_native.ENABLED = True


@pytest.mark.parametrize("n,t", [(1, 1), (1, 8), (3, 5), (4, 1)])
def test_kda_loop_matches_the_torch_ops(n, t):
    inputs = _kda_inputs(n, t, seed=n * 10 + t)
    assert not inputs[2].is_contiguous()
    snap_c, snap_t = torch.zeros(n, 9, *inputs[5].shape[1:]), torch.zeros(n, 9, *inputs[5].shape[1:])
    out_c, final_c = kda_ops.kda_recurrent(*inputs, snap_c)
    out_t, final_t = _torch_ops(kda_ops.kda_recurrent, *inputs, snap_t)
    torch.testing.assert_close(out_c, out_t, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final_c, final_t, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(snap_c, snap_t, rtol=1e-5, atol=1e-5)
    assert not snap_c[:, t:].any()  # steps past T untouched
    assert torch.equal(final_c, snap_c[:, t - 1])
    assert not torch.equal(inputs[5], final_c)  # the caller's state is not written


@pytest.mark.parametrize("snap_dtype", [torch.float32, torch.float64])
def test_kda_verify_equals_decode_step_by_step_bit_for_bit(snap_dtype):
    """What speculative decoding needs: T steps in one call give exactly what T one-step calls give, snapshots
    included (a float64 scratch is written through a float32 temporary)."""
    q, k, v, g, beta, state = _kda_inputs(2, 7, seed=3)
    snapshots = torch.zeros(2, 8, *state.shape[1:], dtype=snap_dtype)
    out, final = kda_ops.kda_recurrent(q, k, v, g, beta, state, snapshots)
    current = state
    for t in range(7):
        step, current = kda_ops.kda_recurrent(q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1], g[:, t : t + 1],
                                              beta[:, t : t + 1], current)
        assert torch.equal(step[:, 0], out[:, t])
        assert torch.equal(snapshots[:, t], current.to(snap_dtype))
    assert torch.equal(current, final)


def test_kda_loop_stands_aside_for_autograd_and_when_switched_off():
    q, k, v, g, beta, state = _kda_inputs(1, 3)
    q = q.clone().requires_grad_()
    assert cpu_native.kda_recurrent(q, k, v, g, beta, state, None) is None  # training: PyTorch's ops, with grads
    out, _ = kda_ops.kda_recurrent(q, k, v, g, beta, state)
    out.sum().backward()
    assert q.grad is not None and q.grad.abs().sum() > 0
    with torch.no_grad():
        assert cpu_native.kda_recurrent(q, k, v, g, beta, state, None) is not None
        cpu_native.ENABLED = False
        try:
            assert cpu_native.kda_recurrent(q, k, v, g, beta, state, None) is None
        finally:
            cpu_native.ENABLED = True


def test_markov_chain_matches_the_slot_by_slot_form():
    torch.manual_seed(0)
    head = MarkovHead(vocab_size=300, rank=16)
    gen = torch.Generator().manual_seed(1)
    for _ in range(20):
        base = torch.randn(3, 6, 300, generator=gen) * 4
        last = torch.randint(0, 300, (3,), generator=gen)
        fused = head.greedy_drafts(base, last)
        slot_by_slot, _ = _markov_drafts(base, last.tolist(), head.steps(None),
                                         lambda corrected: (corrected.argmax(dim=-1), None))
        assert fused is not None and torch.equal(fused, slot_by_slot)


def test_markov_chain_ties_nan_and_bad_ids():
    """Ties go to the lowest index and a NaN wins (torch.argmax's rules); a previous token outside the head is
    a ValueError, not a read past the table; a head written again is transposed again."""
    head = MarkovHead(vocab_size=8, rank=2)
    with torch.no_grad():
        head.markov_w1.weight.zero_()
        head.markov_w2.weight.zero_()
    base = torch.zeros(1, 2, 8)
    base[0, 0, 3] = base[0, 0, 5] = 1.0
    base[0, 1, 6] = float("nan")
    base[0, 1, 2] = 9.0
    assert head.greedy_drafts(base, torch.tensor([0])).tolist() == [[3, 6]]
    with pytest.raises(ValueError, match="outside the Markov head"):
        head.greedy_drafts(base, torch.tensor([8]))
    with torch.no_grad():
        head.markov_w1.weight.fill_(1.0)
        head.markov_w2.weight[7] = 100.0  # every previous token now pushes token 7
    assert head.greedy_drafts(torch.zeros(1, 2, 8), torch.tensor([0])).tolist() == [[7, 7]]


def test_build_is_cached_by_content(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_NATIVE_CACHE", str(tmp_path))
    first = cpu_native.build()
    assert first.parent == tmp_path and first.exists()
    stamp = first.stat().st_mtime_ns
    assert cpu_native.build() == first and first.stat().st_mtime_ns == stamp  # not rebuilt
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no partial files left


def test_a_missing_compiler_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_NATIVE_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(OSError):
        cpu_native.build()
    assert list(tmp_path.iterdir()) == []
