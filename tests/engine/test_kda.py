"""Kimi Delta Attention maths: chunked and recurrent forms agree, carry state, and match transformers."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.layers.kda_ops import (
    MAX_FACTORED_DECAY, causal_conv, kda_chunked, kda_gate, kda_recurrent, l2_normalize,
)


def _inputs(seq_len: int, heads: int = 3, dim: int = 8, seed: int = 0, lower_bound: float | None = None):
    gen = torch.Generator().manual_seed(seed)
    q = l2_normalize(torch.randn(seq_len, heads, dim, generator=gen)) * dim ** -0.5
    k = l2_normalize(torch.randn(seq_len, heads, dim, generator=gen))
    v = torch.randn(seq_len, heads, dim, generator=gen)
    forget = torch.randn(seq_len, heads, dim, generator=gen)
    g = kda_gate(forget, torch.randn(heads, dim, generator=gen) * 0.5, torch.rand(heads, generator=gen) * 2, lower_bound)
    beta = torch.rand(seq_len, heads, generator=gen)
    state = torch.randn(heads, dim, dim, generator=gen) * 0.1
    return q, k, v, g, beta, state


@pytest.mark.parametrize("lower_bound", [None, -5.0])
@pytest.mark.parametrize("chunk_size", [1, 7, 16, 64])
def test_chunked_equals_recurrent(chunk_size, lower_bound):
    """The chunked form (any chunk size) gives the recurrent form's outputs and final state."""
    q, k, v, g, beta, state = _inputs(150, lower_bound=lower_bound)
    out_r, state_r = kda_recurrent(q[None], k[None], v[None], g[None], beta[None], state[None])
    out_c, state_c = kda_chunked(q, k, v, g, beta, state, chunk_size)
    torch.testing.assert_close(out_c, out_r[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state_c, state_r[0], atol=1e-5, rtol=1e-5)


def test_wide_decay_chunks_fall_back_to_the_exact_form():
    """Chunks whose log-decay goes deeper than MAX_FACTORED_DECAY (e^{-G} would overflow float32 when factored)
    still match the recurrent form, next to chunks that are factored, with finite outputs."""
    q, k, v, g, beta, state = _inputs(48, lower_bound=-5.0)
    g[16:32, :, ::2] = -30.0  # the middle chunk of 16: a log-decay of 480 in half the channels
    assert float(-g[16:32].sum(0).min()) > MAX_FACTORED_DECAY
    out_r, state_r = kda_recurrent(q[None], k[None], v[None], g[None], beta[None], state[None])
    out_c, state_c = kda_chunked(q, k, v, g, beta, state, 16)
    assert torch.isfinite(out_c).all() and torch.isfinite(state_c).all()
    torch.testing.assert_close(out_c, out_r[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state_c, state_r[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_outputs_do_not_depend_on_later_tokens(lower_bound):
    """Bit for bit, output t depends only on tokens <= t (also inside a chunk): two sequences of one length
    that differ only after position 20 give identical outputs up to 20."""
    q, k, v, g, beta, state = _inputs(40, lower_bound=lower_bound)
    other = _inputs(40, seed=1, lower_bound=lower_bound)
    mixed = [torch.cat([a[:21], b[21:]]) for a, b in zip((q, k, v, g, beta), other)]
    out, _ = kda_chunked(q, k, v, g, beta, state, 16)
    out_mixed, _ = kda_chunked(*mixed, state, 16)
    assert torch.equal(out[:21], out_mixed[:21])
    assert not torch.equal(out[21:], out_mixed[21:])


def test_state_carries_across_calls():
    """Running a sequence in two calls, the second starting from the first's state, equals one call."""
    q, k, v, g, beta, state = _inputs(100)
    whole, final = kda_chunked(q, k, v, g, beta, state)
    first, mid = kda_chunked(q[:37], k[:37], v[:37], g[:37], beta[:37], state)
    second, end = kda_chunked(q[37:], k[37:], v[37:], g[37:], beta[37:], mid)
    torch.testing.assert_close(torch.cat([first, second]), whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(end, final, atol=1e-5, rtol=1e-5)


def test_matches_transformers_reference():
    """Our chunked/recurrent forms agree with transformers' kimi_linear torch reference (separate code)."""
    from transformers.models.kimi_linear import modeling_kimi_linear as hf

    q, k, v, g, beta, state = _inputs(90)
    # transformers takes raw q/k (normalising and scaling inside) and [B, T, H, D] tensors.
    raw_q = q / (q.shape[-1] ** -0.5)
    ref_out, ref_state = hf.chunk_kimi_delta_attention(
        raw_q[None], k[None], v[None], g[None], beta[None], initial_state=state[None], output_final_state=True,
    )
    out, final = kda_chunked(q, k, v, g, beta, state)
    torch.testing.assert_close(out, ref_out[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(final, ref_state[0], atol=1e-4, rtol=1e-4)


def test_batched_recurrent_equals_one_by_one():
    """Sequences advancing together in one recurrent call equal each advanced alone."""
    runs = [_inputs(5, seed=s) for s in range(3)]
    stacked = [torch.stack([r[i] for r in runs]) for i in range(6)]
    out, final = kda_recurrent(*stacked)
    for n, r in enumerate(runs):
        alone, alone_state = kda_recurrent(*(t[None] for t in r))
        torch.testing.assert_close(out[n], alone[0], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(final[n], alone_state[0], atol=1e-6, rtol=1e-6)


def test_gate_formulas():
    """Kimi Linear gate = -exp(A_log) softplus(z); K3 safe gate = lb * sigmoid(exp(A_log) z), inside (lb, 0)."""
    gen = torch.Generator().manual_seed(3)
    forget = torch.randn(4, 2, 3, generator=gen) * 10
    dt_bias, a_log = torch.randn(2, 3, generator=gen), torch.randn(2, generator=gen)
    z = forget + dt_bias
    rate = a_log.exp()[None, :, None]
    torch.testing.assert_close(kda_gate(forget, dt_bias, a_log, None), -rate * F.softplus(z))
    safe = kda_gate(forget, dt_bias, a_log, -5.0)
    torch.testing.assert_close(safe, -5.0 * torch.sigmoid(rate * z))
    assert bool((safe <= 0).all() and (safe >= -5).all())  # (-5, 0) in exact arithmetic; fp32 saturates


def test_causal_conv_matches_conv1d_and_carries_window():
    """The windowed conv equals a padded depthwise conv1d; splitting the sequence with the window equals one pass."""
    gen = torch.Generator().manual_seed(1)
    x, weight = torch.randn(20, 6, generator=gen), torch.randn(6, 4, generator=gen)
    zero = torch.zeros(3, 6)
    out, window = causal_conv(x, zero, weight)
    ref = F.silu(F.conv1d(x.T[None], weight[:, None], padding=3, groups=6)[0, :, :20].T)
    torch.testing.assert_close(out, ref)
    assert torch.equal(window, x[-3:])
    first, mid = causal_conv(x[:2], zero, weight)
    second, _ = causal_conv(x[2:], mid, weight)
    torch.testing.assert_close(torch.cat([first, second]), out)


def test_fla_self_check_accepts_agreeing_and_rejects_wrong_kernels():
    """The optional fla kernel is used only when it agrees with the torch reference: an agreeing kernel
    passes the check, a wrong one or one with another signature is rejected; on CPU fla is never used."""
    from engine.layers import kda_fla

    def agreeing(q, k, v, g, beta, scale, initial_state, output_final_state):
        assert scale == 1.0 and output_final_state
        out, state = kda_chunked(q[0], k[0], v[0], g[0], beta[0], initial_state[0])
        return out[None], state[None]

    def wrong(q, k, v, g, beta, scale, initial_state, output_final_state):
        out, state = agreeing(q, k, v, g, beta, scale, initial_state, output_final_state)
        return out + 0.1, state

    def other_signature(q, k, v, g, beta):
        return q, k

    cpu = torch.device("cpu")
    assert kda_fla._self_check(agreeing, cpu)
    assert not kda_fla._self_check(wrong, cpu)
    assert not kda_fla._self_check(other_signature, cpu)
    assert kda_fla.fla_chunked_kda(cpu) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_verify_snapshots_equal_token_by_token_decode(dtype):
    """A verify call over T tokens writes, at snapshot t, exactly the state T one-token decode calls leave after
    token t, and its outputs equal theirs bit for bit (float32 scratch written in place, another dtype copied)."""
    q, k, v, g, beta, state = _inputs(6, seed=3)
    snapshots = torch.zeros(1, 8, *state.shape, dtype=dtype)
    out, _ = kda_recurrent(q[None], k[None], v[None], g[None], beta[None], state[None], snapshots)
    current = state[None]
    for t in range(6):
        step_out, current = kda_recurrent(q[None, t : t + 1], k[None, t : t + 1], v[None, t : t + 1],
                                          g[None, t : t + 1], beta[None, t : t + 1], current)
        assert torch.equal(out[0, t], step_out[0, 0])
        assert torch.equal(snapshots[0, t], current[0].to(dtype))
    assert not snapshots[0, 6:].any()  # positions past T untouched


def test_batched_conv_equals_per_sequence_conv():
    """causal_conv_batch over N sequences equals causal_conv of each; its window's rows t+1..t+W-1 are the
    state after input t."""
    from engine.layers.kda_ops import causal_conv_batch, conv_windows

    gen = torch.Generator().manual_seed(4)
    x, state, weight = torch.randn(3, 5, 12, generator=gen), torch.randn(3, 3, 12, generator=gen), torch.randn(12, 4)
    out, window = causal_conv_batch(x, state, weight)
    for n in range(3):
        alone, new_state = causal_conv(x[n], state[n], weight)
        torch.testing.assert_close(out[n], alone)
        assert torch.equal(window[n, -3:], new_state)
        assert torch.equal(window[n].unfold(0, 3, 1)[1:].transpose(1, 2), conv_windows(x[n], state[n]))
