"""spec_decode.propose for greedy sequences: the drafts are the argmax of each sequence's own draft rows, cut to
what the sequence may still emit - whether the whole block is taken in one argmax (every sequence full) or cut."""
from __future__ import annotations

import pytest
import torch

from engine.spec import spec_decode
from engine.cache.kv_cache import PageAllocator, PageTable
from engine.sampling_params import SamplingParams
from engine.runtime.sequence import Sequence

BLOCK, VOCAB = 5, 11


def _sequence(name: str, generated: int, max_new: int, allocator: PageAllocator) -> Sequence:
    prompt = [4, 5, 6]
    seq = Sequence(name, len(prompt), prompt + [7] * generated,
                   SamplingParams(temperature=0.0, max_new_tokens=max_new), PageTable(allocator, 4))
    seq.num_cached = seq.num_tokens - 1
    return seq


@pytest.mark.parametrize("max_new", [[20, 20, 20], [20, 3, 20], [2, 20, 1]])
def test_greedy_drafts_are_each_rows_argmax_cut_to_what_is_left(max_new: list[int]) -> None:
    """Each greedy sequence gets argmax(its rows)[:min(block - 1, tokens left)]; a sequence with nothing left gets
    no entry; the full-block fast path and the cut path agree with the per-row reference."""
    allocator = PageAllocator(16)
    group = [_sequence(f"r{i}", 1, limit, allocator) for i, limit in enumerate(max_new)]
    logits = torch.randn(len(group) * (BLOCK - 1), VOCAB, generator=torch.Generator().manual_seed(3))
    proposals = spec_decode.propose(lambda plan: logits, BLOCK, group)
    rows = logits.view(len(group), BLOCK - 1, VOCAB)
    expected = {}
    for i, seq in enumerate(group):
        count = min(BLOCK - 1, max_new[i] - seq.num_generated)
        if count > 0:
            expected[seq.request_id] = (rows[i, :count].argmax(dim=-1).tolist(), None)
    assert proposals == expected
