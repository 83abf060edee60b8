"""Draft-context writes only for requests that may speculate: a forward whose requests all have
speculative=False stores no draft context (no context_entries call), while output stays identical."""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.runtime.outputs import PrefillJob
from engine.sampling_params import speculates
from tests.engine.spec_fixtures import add_random_draft, make_tiny_checkpoint

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [4, 9, 2, 7, 3]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("ctx") / "m", "heads24")
    add_random_draft(path, block_size=4)
    return str(path)


class EntryCounter:
    """Wraps draft.context_entries and counts the token rows it was asked for."""

    def __init__(self, draft) -> None:
        self.rows = 0
        self._inner = draft.context_entries
        draft.context_entries = self

    def __call__(self, captured, positions):
        self.rows += positions.numel()
        return self._inner(captured, positions)


def test_speculates_needs_a_draft_and_a_request_that_may_speculate():
    """speculates(): False without a draft or when every request says speculative=False; True otherwise."""
    off, auto, on = (SamplingParams(speculative=s) for s in (False, None, True))
    assert not speculates([on], has_draft=False)
    assert not speculates([off, off], has_draft=True)
    assert not speculates([], has_draft=True)
    assert speculates([off, auto], has_draft=True) and speculates([on], has_draft=True)


def test_non_speculating_requests_write_no_draft_context(model_dir):
    """Prefill and decode of speculative=False requests call the draft's context_entries zero times and give
    plain greedy output; speculating requests write an entry for every prompt and verified token."""
    plain = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True, speculative=False)
    spec = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True, speculative=True, block_size=4)
    with LLM(model_dir, attention_backend="torch", draft_model="") as reference:
        expected = reference.generate(PROMPTS, plain)
    with LLM(model_dir, attention_backend="torch", spec_block_size=4) as llm:
        counter = EntryCounter(llm.engine.runner.draft)
        assert llm.generate(PROMPTS, plain) == expected
        assert counter.rows == 0
        assert llm.generate(PROMPTS, spec) == expected
        assert counter.rows >= sum(len(p) for p in PROMPTS)


def test_mixed_batch_keeps_writing_for_the_speculating_request(model_dir):
    """In one batch a speculative=False request beside a speculating one: the forwards still store draft
    context (the speculating request needs it) and both outputs equal plain greedy decoding."""
    plain = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True, speculative=False)
    spec = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True, block_size=4)
    with LLM(model_dir, attention_backend="torch", draft_model="") as reference:
        expected = reference.generate(PROMPTS, plain)
    with LLM(model_dir, attention_backend="torch", spec_block_size=4) as llm:
        counter = EntryCounter(llm.engine.runner.draft)
        engine = llm.engine
        engine.add_request("off", list(PROMPTS[0]), plain)
        engine.add_request("on", list(PROMPTS[1]), spec)
        outputs: dict[str, list[int]] = {"off": [], "on": []}
        while engine.has_work():
            for out in engine.step():
                outputs[out.request_id].extend(out.new_token_ids)
        assert [outputs["off"], outputs["on"]] == expected
        assert llm.acceptance_stats.num_verify_steps > 0
        assert counter.rows >= sum(len(p) for p in PROMPTS)


def test_prefill_jobs_skip_draft_context_for_non_speculating_requests(model_dir):
    """The prefill service path (engine.prefill) stores draft context only for jobs that may speculate."""
    with LLM(model_dir, attention_backend="torch", spec_block_size=4) as llm:
        engine = llm.engine
        counter = EntryCounter(engine.runner.draft)
        pages = engine.allocate_pages(len(PROMPTS[0]))
        try:
            off = SamplingParams(max_new_tokens=4, temperature=0.0, speculative=False)
            assert engine.prefill([PrefillJob("a", list(PROMPTS[0]), off, pages)])[0] is not None
            assert counter.rows == 0
            on = SamplingParams(max_new_tokens=4, temperature=0.0)
            assert engine.prefill([PrefillJob("b", list(PROMPTS[0]), on, pages)])[0] is not None
            assert counter.rows == len(PROMPTS[0])
        finally:
            engine.free_pages(pages)
