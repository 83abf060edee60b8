"""training/kda_train.py: the batched, chunk-parallel KDA used for training is the engine's KDA."""
from __future__ import annotations

import pytest
import torch

from engine.layers.kda_ops import kda_chunked, kda_gate, kda_recurrent, l2_normalize
from training.kda_train import chunk_size_for, kda_chunked_batch


def _inputs(n: int, t: int, h: int, d: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = l2_normalize(torch.randn(n, t, h, d, generator=gen)) * d ** -0.5
    k = l2_normalize(torch.randn(n, t, h, d, generator=gen))
    v = torch.randn(n, t, h, d, generator=gen)
    forget = torch.randn(n * t, h, d, generator=gen) * 2
    g = kda_gate(forget, torch.randn(h, d, generator=gen), torch.randn(h, generator=gen), -5.0).view(n, t, h, d)
    beta = torch.rand(n, t, h, generator=gen)
    return q, k, v, g, beta


@pytest.mark.parametrize("length", [1, 16, 45, 64])
def test_matches_engine_chunked_and_recurrent(length: int) -> None:
    """Every sequence of the batch equals engine kda_chunked and kda_recurrent from a zero state (the
    ragged tail is zero-padded internally), with the K3 safe gate at its steepest (-5 per step)."""
    q, k, v, g, beta = _inputs(3, length, 2, 8)
    out = kda_chunked_batch(q, k, v, g, beta, chunk_size_for(-5.0))
    zero = torch.zeros(2, 8, 8)
    for i in range(3):
        chunked, _ = kda_chunked(q[i], k[i], v[i], g[i], beta[i], zero)
        torch.testing.assert_close(out[i], chunked, atol=2e-5, rtol=1e-4)
    recurrent, _ = kda_recurrent(q, k, v, g, beta, torch.zeros(3, 2, 8, 8))
    torch.testing.assert_close(out, recurrent, atol=2e-5, rtol=1e-4)


def test_gradients_match_the_recurrent_form() -> None:
    """Backward through the chunk-parallel form gives the recurrent form's gradients."""
    inputs = [x.clone().requires_grad_(True) for x in _inputs(2, 37, 2, 4, seed=1)]
    twins = [x.detach().clone().requires_grad_(True) for x in inputs]
    kda_chunked_batch(*inputs, 16).square().sum().backward()
    kda_recurrent(*twins, torch.zeros(2, 2, 4, 4))[0].square().sum().backward()
    for mine, ref in zip(inputs, twins):
        torch.testing.assert_close(mine.grad, ref.grad, atol=1e-4, rtol=1e-3)


def test_chunk_size_keeps_the_decay_in_float32_range() -> None:
    """The chunk is the largest power of two with chunk * |lower bound| <= 80; no bound is refused."""
    assert chunk_size_for(-5.0) == 16
    assert chunk_size_for(-1.0) == 64
    with pytest.raises(ValueError, match="gate_lower_bound"):
        chunk_size_for(0.0)
