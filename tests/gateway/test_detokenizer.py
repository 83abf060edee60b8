"""Incremental detokenization: deltas never contain a broken UTF-8 character and concatenate to the full decode."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from gateway.detokenizer import REPLACEMENT, IncrementalDetokenizer
from gateway.tokenizer import TextTokenizer
from tests.gateway.text_tokenizer import make_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> TextTokenizer:
    return TextTokenizer.from_file(make_tokenizer(tmp_path_factory.mktemp("tok")))


TEXTS = ["日本語のテキストと中文字符", "emoji 🙂🚀 and ∑ ≠ ∞", "naïve café", "plain ascii text\n", "🙂"]


@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_holds_back_partial_characters(tokenizer, text):
    """Feeding tokens one by one, no delta contains U+FFFD and the deltas join to the original text."""
    ids = tokenizer.encode(text)
    assert any(REPLACEMENT in tokenizer.decode([i]) for i in ids) or text.isascii()
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.add([token]) for token in ids] + [detok.flush()]
    assert all(REPLACEMENT not in delta for delta in deltas)
    assert "".join(deltas) == text == tokenizer.decode(ids)


def test_an_incomplete_character_emits_nothing_until_completed(tokenizer):
    """A token holding only the first bytes of a character produces an empty delta."""
    ids = tokenizer.encode("🙂")
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.add(ids[:1]) == ""
    assert detok.add(ids[1:]) == "🙂"


def test_flush_releases_a_dangling_partial_character(tokenizer):
    """When the output ends mid-character the held bytes are flushed (as U+FFFD), so nothing is lost."""
    ids = tokenizer.encode("ok🙂")
    detok = IncrementalDetokenizer(tokenizer)
    first = detok.add(ids[:-1])
    assert REPLACEMENT not in first and first.startswith("ok")
    assert detok.flush() == tokenizer.decode(ids[:-1])[len(first):]


def test_prompt_context_is_not_emitted(tokenizer):
    """Prompt tokens given as context never appear in the deltas."""
    prompt = tokenizer.encode("import os, sys")
    out = tokenizer.encode(" café 🙂")
    detok = IncrementalDetokenizer(tokenizer, prompt)
    text = "".join(detok.add([t]) for t in out) + detok.flush()
    assert text == tokenizer.decode(out)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(list("aé日🙂 ∑\nx")), min_size=1, max_size=30), st.integers(1, 4))
def test_any_split_into_groups_concatenates_to_the_decode(tokenizer, chars, group):
    """For arbitrary text and token group sizes, concatenated deltas == decode(all ids), with no U+FFFD."""
    text = "".join(chars)
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.add(ids[i:i + group]) for i in range(0, len(ids), group)] + [detok.flush()]
    assert all(REPLACEMENT not in delta for delta in deltas)
    assert "".join(deltas) == tokenizer.decode(ids) == text
