"""KDA over a batch of sequences of different lengths (prefill, a verify step with clipped blocks): the
sequences are grouped by length and each group runs as one batched call, instead of one call per sequence.

The recurrence is independent per (sequence, head), so n sequences of the same length L go through the
one-sequence chunked form as one sequence of n * H heads ([n, L, H, D] -> [L, n * H, D]), and through the
recurrent and conv forms with their batch dimension. Every op works row by row over that batch (batched
matmuls, a batched triangular solve, elementwise maths), so a sequence's outputs and states do not depend on
which other sequences share its group (tests/engine/test_kda_ragged.py checks them equal to one call per
sequence). Pure functions on plain tensors; engine/layers/kda.py reads and writes the state pools."""
from __future__ import annotations

import torch

from engine.layers.kda_ops import causal_conv_batch, kda_chunked, kda_recurrent


def length_groups(lengths: tuple[int, ...]) -> list[tuple[int, tuple[int, ...]]]:
    """(length, batch positions having it) per distinct length, in order of first appearance."""
    groups: dict[int, list[int]] = {}
    for position, length in enumerate(lengths):
        groups.setdefault(length, []).append(position)
    return [(length, tuple(members)) for length, members in groups.items()]


def token_rows(lengths: tuple[int, ...], members: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The packed token rows of sequences `members` (all of one length), sequence-major: [n * L] int64."""
    starts, start = [], 0
    for length in lengths:
        starts.append(start)
        start += length
    length = lengths[members[0]]
    return torch.tensor([starts[i] + t for i in members for t in range(length)], dtype=torch.long, device=device)


def stack_heads(x: torch.Tensor) -> torch.Tensor:
    """[n, L, H, ...] -> [L, n * H, ...]: n sequences as the heads of one sequence."""
    n, length, heads = x.shape[:3]
    return x.transpose(0, 1).reshape(length, n * heads, *x.shape[3:])


def kda_chunked_group(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      state: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """kda_chunked for n sequences of one length: q, k, g [n, L, H, K]; v [n, L, H, V]; beta [n, L, H];
    state [n, H, K, V] -> (o [n, L, H, V], final state [n, H, K, V]), float32."""
    n, length, heads = q.shape[:3]
    out, final = kda_chunked(*(stack_heads(x) for x in (q, k, v, g, beta)),
                             state.reshape(n * heads, *state.shape[2:]), chunk_size)
    return out.view(length, n, heads, -1).transpose(0, 1), final.view(n, heads, *final.shape[1:])


def kda_recurrent_group(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        state: torch.Tensor, snapshots: torch.Tensor | None, members: tuple[int, ...]
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """kda_recurrent for n sequences of one length L (shapes as kda_chunked_group). snapshots: the step's
    scratch [rows, >= L, H, K, V] (or None); the states after each position go to rows `members` - written in
    place when the members are consecutive rows, else through one temporary."""
    if snapshots is None:
        return kda_recurrent(q, k, v, g, beta, state)
    first, length = members[0], q.shape[1]
    if members == tuple(range(first, first + len(members))):
        return kda_recurrent(q, k, v, g, beta, state, snapshots[first : first + len(members)])
    scratch = torch.empty((len(members), length, *state.shape[1:]), dtype=torch.float32, device=state.device)
    out, final = kda_recurrent(q, k, v, g, beta, state, scratch)
    index = torch.tensor(members, dtype=torch.long, device=snapshots.device)
    snapshots[index, :length] = scratch.to(snapshots.dtype)
    return out, final


def conv_group(mixed: torch.Tensor, windows: torch.Tensor, weight: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The causal conv of n sequences of L new inputs: mixed [n, L, C], windows [n, W-1, C] (their previous
    inputs) -> (silu(conv) [n, L, C] float32, the new windows [n, W-1, C], the window after each position
    [n, L, W-1, C] (speculative verify keeps them))."""
    width = windows.shape[1]
    out, window = causal_conv_batch(mixed, windows, weight)
    after = window.unfold(1, width, 1)[:, 1:].transpose(2, 3)
    return out, window[:, -width:], after
