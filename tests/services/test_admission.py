"""The decode worker's pure admission rules and output merging."""
from __future__ import annotations

from types import SimpleNamespace

from decode_worker.admission import admits, fits_ever, growth_pages, headroom, merge_outputs, new_tokens, pages_for


def test_headroom_scales_with_running_requests():
    """Each running request keeps enough pages for one speculative block crossing a page boundary."""
    assert pages_for(17, 16) == 2 and pages_for(16, 16) == 1
    assert growth_pages(8, 16) == 2 and growth_pages(31, 16) == 3
    assert headroom(0, 8, 16) == 0 and headroom(5, 8, 16) == 10


def test_admits_only_when_headroom_remains():
    """A reservation is admitted iff the pages left after it cover the running requests' headroom."""
    assert admits(free_pages=12, num_prompt_tokens=32, running=5, spec_block_size=8, page_size=16)  # 12 - 2 >= 10
    assert not admits(free_pages=11, num_prompt_tokens=32, running=5, spec_block_size=8, page_size=16)
    assert admits(free_pages=2, num_prompt_tokens=32, running=0, spec_block_size=8, page_size=16)


def test_fits_ever_uses_the_worst_case():
    """A request whose prompt + max_new_tokens + one block exceeds the whole pool can never run."""
    assert fits_ever(100, 20, 8, 16, total_pages=8)      # 128 tokens -> 8 pages
    assert not fits_ever(100, 21, 8, 16, total_pages=8)  # 129 tokens -> 9 pages


def _out(tokens, finished=False, reason=None, logprobs=()):
    return SimpleNamespace(new_token_ids=list(tokens), finished=finished, finish_reason=reason, logprobs=list(logprobs))


def test_merge_drops_the_prefill_token_once_and_keeps_the_last_state():
    """Merged outputs: the first token of the first non-empty output is dropped (prefill returned it),
    tokens and logprobs concatenate, the finish state is the last output's and steps count outputs."""
    update = merge_outputs([_out([]), _out([7, 8], logprobs=["lp8"]), _out([9], True, "length", ["lp9"])], True)
    assert (update.token_ids, update.logprobs, update.finished, update.finish_reason, update.steps) == \
        ([8, 9], ["lp8", "lp9"], True, "length", 3)
    assert merge_outputs([_out([4, 5])], False).token_ids == [4, 5]


def test_new_tokens_counts_what_the_merge_carries():
    """new_tokens (the stream_interval test) equals the length of the merged update, the re-emitted
    prefill token excluded only when it is there to drop."""
    for outputs in ([], [_out([])], [_out([7])], [_out([]), _out([7, 8]), _out([9], True)], [_out([4, 5])]):
        for skip in (True, False):
            assert new_tokens(outputs, skip) == len(merge_outputs(outputs, skip).token_ids)
