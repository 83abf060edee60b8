"""engine/layers/kda_ragged.py: a group of same-length sequences run as one batched call gives every sequence
what one call per sequence gives it, for the chunked, recurrent and conv forms, and the grouping / row
bookkeeping is right for ragged batches. Equal to float32 rounding, not bit for bit: PyTorch's CPU elementwise
kernels run full vector lanes through vectorised exp / sigmoid and the tail through scalar code, so a row's
last bit can change with the size of the tensor it sits in (the engine is batch-invariant to that level)."""
from __future__ import annotations

import torch

from engine.layers.kda_ops import causal_conv, conv_windows, kda_chunked, kda_gate, kda_recurrent, l2_normalize
from engine.layers.kda_ragged import (conv_group, kda_chunked_group, kda_recurrent_group, length_groups, stack_heads,
                                      token_rows)

N, L, H, K, V = 3, 21, 2, 8, 6


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, rtol=1e-6, atol=1e-6)


def _inputs(seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = l2_normalize(torch.randn(N, L, H, K, generator=gen)) * K ** -0.5
    k = l2_normalize(torch.randn(N, L, H, K, generator=gen))
    v = torch.randn(N, L, H, V, generator=gen)
    g = kda_gate(torch.randn(N * L, H, K, generator=gen), torch.zeros(H, K), torch.zeros(H), -5.0).view(N, L, H, K)
    beta = torch.sigmoid(torch.randn(N, L, H, generator=gen))
    state = torch.randn(N, H, K, V, generator=gen)
    return q, k, v, g, beta, state


def test_length_groups_and_token_rows_follow_the_packed_layout():
    """Positions are grouped by length in order of first appearance; a group's rows are its sequences' packed
    token rows, sequence-major."""
    lengths = (2, 3, 2, 1, 3)
    assert length_groups(lengths) == [(2, (0, 2)), (3, (1, 4)), (1, (3,))]
    assert token_rows(lengths, (1, 4), torch.device("cpu")).tolist() == [2, 3, 4, 8, 9, 10]
    assert token_rows(lengths, (0, 2), torch.device("cpu")).tolist() == [0, 1, 5, 6]
    x = torch.arange(2 * 3 * 4).view(2, 3, 4, 1)
    assert torch.equal(stack_heads(x)[1, 4:], x[1, 1])


def test_chunked_group_equals_one_call_per_sequence():
    """n sequences stacked as heads: the same outputs and final states as n separate kda_chunked calls."""
    q, k, v, g, beta, state = _inputs()
    out, final = kda_chunked_group(q, k, v, g, beta, state, 16)
    for i in range(N):
        o_i, s_i = kda_chunked(q[i], k[i], v[i], g[i], beta[i], state[i], 16)
        assert _same(out[i], o_i) and _same(final[i], s_i)


def test_recurrent_group_writes_snapshots_of_scattered_members():
    """Members that are not consecutive rows get their per-position states in their own snapshot rows (through
    a temporary), equal to a per-sequence call; other rows stay untouched."""
    q, k, v, g, beta, state = _inputs(1)
    snapshots = torch.full((5, L + 2, H, K, V), 7.0)
    out, final = kda_recurrent_group(q, k, v, g, beta, state, snapshots, (0, 2, 4))
    for i, row in enumerate((0, 2, 4)):
        own = torch.zeros(1, L, H, K, V)
        o_i, s_i = kda_recurrent(q[i : i + 1], k[i : i + 1], v[i : i + 1], g[i : i + 1], beta[i : i + 1],
                                 state[i : i + 1], own)
        assert _same(out[i], o_i[0]) and _same(final[i], s_i[0])
        assert _same(snapshots[row, :L], own[0])
    assert bool((snapshots[1] == 7.0).all()) and bool((snapshots[0, L:] == 7.0).all())
    consecutive = torch.zeros(5, L, H, K, V)
    kda_recurrent_group(q, k, v, g, beta, state, consecutive, (1, 2, 3))
    assert _same(consecutive[1:4], snapshots[(0, 2, 4), :L])


def test_conv_group_equals_per_sequence_conv_and_windows():
    """The batched conv gives each sequence causal_conv's output and new window, and conv_windows' per-position
    windows."""
    gen = torch.Generator().manual_seed(2)
    mixed, windows, weight = torch.randn(N, 5, 12, generator=gen), torch.randn(N, 3, 12, generator=gen), torch.randn(12, 4, generator=gen)
    out, new, after = conv_group(mixed, windows, weight)
    for i in range(N):
        o_i, w_i = causal_conv(mixed[i], windows[i], weight)
        assert _same(out[i], o_i) and torch.equal(new[i], w_i)
        assert torch.equal(after[i], conv_windows(mixed[i], windows[i]))
