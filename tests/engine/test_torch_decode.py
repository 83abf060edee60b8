"""The torch backend's batched absorbed decode equals attention computed one sequence at a time (uniform and
mixed query counts, ragged contexts, several groups under a small score budget), and the step layout is
built once per metadata object and reused by every layer."""
from __future__ import annotations

import pytest
import torch

from engine.attention.torch_backend import TorchAttentionBackend
from engine.attention.torch_decode import build_decode_layout, decode_attention, split_groups
from engine.runtime.forward_batch import build_attention_metadata

PAGE, LATENT, ROPE, HEADS = 4, 12, 4, 3


def _reference(q, kv_cache, q_lens, kv_lens, tables, scale):
    """Per sequence: gather its context page by page, causal bottom-right softmax attention in float64."""
    flat = kv_cache.reshape(-1, kv_cache.shape[-1]).double()
    out, start = [], 0
    for q_len, kv_len, pages in zip(q_lens, kv_lens, tables):
        slots = [pages[p // PAGE] * PAGE + p % PAGE for p in range(kv_len)]
        context = flat[slots]  # [L, D]
        queries = q[start : start + q_len].double()  # [Q, H, D]
        scores = torch.einsum("qhd,ld->qhl", queries, context) * scale
        for j in range(q_len):
            scores[j, :, kv_len - q_len + j + 1 :] = float("-inf")
        out.append(torch.einsum("qhl,ld->qhd", scores.softmax(-1), context[:, :LATENT]))
        start += q_len
    return torch.cat(out).float()


def _case(q_lens, kv_lens, seed):
    generator = torch.Generator().manual_seed(seed)
    num_pages = sum(-(-k // PAGE) for k in kv_lens) + 2
    kv_cache = torch.randn(num_pages, PAGE, LATENT + ROPE, generator=generator)
    order = torch.randperm(num_pages, generator=generator).tolist()
    tables = []
    for kv_len in kv_lens:
        count = -(-kv_len // PAGE)
        tables.append(order[:count])
        order = order[count:]
    q = torch.randn(sum(q_lens), HEADS, LATENT + ROPE, generator=generator)
    return q, kv_cache, tables


CASES = [  # q_lens, kv_lens
    ((1,), (7,)),
    ((1, 1, 1), (5, 5, 5)),
    ((1, 1, 1, 1), (3, 9, 4, 12)),
    ((4, 4), (6, 11)),
    ((1, 3, 2), (4, 10, 7)),
]


@pytest.mark.parametrize("budget", [10**6, 40])
@pytest.mark.parametrize("q_lens,kv_lens", CASES)
def test_batched_decode_equals_per_sequence_attention(q_lens, kv_lens, budget):
    """Every query row equals its own sequence's causal attention (float32 vs float64 reference, 1e-5),
    whether the sequences share one padded group or are split into several by a small budget."""
    q, kv_cache, tables = _case(q_lens, kv_lens, seed=sum(kv_lens) + budget)
    attn = build_attention_metadata(list(q_lens), list(kv_lens), tables, PAGE)
    layout = build_decode_layout(attn, HEADS, budget)
    assert sum(g.num_seqs for g in layout) == len(q_lens)
    out = decode_attention(q, kv_cache, layout, 0.3, LATENT)
    torch.testing.assert_close(out, _reference(q, kv_cache, q_lens, kv_lens, tables, 0.3), rtol=1e-5, atol=1e-5)


def test_uniform_steps_need_no_gather_and_plain_decode_no_mask():
    """Plain decode with equal contexts masks nothing and gathers no query rows; mixed query counts do."""
    attn = build_attention_metadata([1, 1], [6, 6], [[0, 1], [2, 3]], PAGE)
    (group,) = build_decode_layout(attn, HEADS, 10**6)
    assert group.hidden is None and group.rows is None and group.valid is None
    attn = build_attention_metadata([1, 2], [6, 6], [[0, 1], [2, 3]], PAGE)
    (group,) = build_decode_layout(attn, HEADS, 10**6)
    assert group.hidden is not None and group.rows.tolist() == [0, 0, 1, 2] and group.valid.tolist() == [0, 2, 3]


def test_split_groups_respects_the_budget():
    """Groups are consecutive, cover every sequence once, and each padded score tensor fits the budget
    unless a sequence is alone."""
    q_lens, kv_lens = (1, 2, 1, 4, 1), (10, 3, 30, 8, 9)
    groups = split_groups(q_lens, kv_lens, 2, 100)
    assert [i for first, last in groups for i in range(first, last)] == list(range(5))
    for first, last in groups:
        size = (last - first) * 2 * max(q_lens[first:last]) * max(kv_lens[first:last])
        assert size <= 100 or last - first == 1


def test_backend_builds_the_layout_once_per_step():
    """Layers of one step share the layout (same metadata object); a new step's metadata rebuilds it."""
    backend = TorchAttentionBackend()
    q, kv_cache, tables = _case((1, 1), (5, 9), seed=0)
    attn = build_attention_metadata([1, 1], [5, 9], tables, PAGE)
    first = backend.decode(q, kv_cache, attn, 0.5, LATENT)
    layout = backend._layout
    second = backend.decode(q, kv_cache, attn, 0.5, LATENT)
    assert backend._layout is layout
    torch.testing.assert_close(first, second, rtol=0, atol=0)
    backend.decode(q, kv_cache, build_attention_metadata([1, 1], [5, 9], tables, PAGE), 0.5, LATENT)
    assert backend._layout is not layout
