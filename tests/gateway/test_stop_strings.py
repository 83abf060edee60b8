"""Stop strings over text deltas: output is truncated before the first stop, and partial matches are held back."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from gateway.stop_strings import StopStringMatcher


def run(stops, deltas):
    matcher = StopStringMatcher(stops)
    out, matched = [], None
    for delta in deltas:
        text, matched = matcher.feed(delta)
        out.append(text)
        if matched:
            break
    else:
        out.append(matcher.flush())
    return "".join(out), matched, out


def test_stop_spanning_deltas_is_found_and_truncated():
    """A stop string split over three deltas matches; nothing of it is emitted."""
    text, matched, parts = run(["STOP"], ["abc S", "T", "OP tail"])
    assert (text, matched) == ("abc ", "STOP")
    assert all("S" not in part for part in parts)


def test_partial_match_that_fails_is_released():
    """Held-back text that turns out not to be a stop is emitted later, in order."""
    text, matched, parts = run(["STOP"], ["abc ST", "ack", " end"])
    assert (text, matched) == ("abc STack end", None)
    assert parts[0] == "abc "


def test_first_completed_of_several_stops_wins():
    """With several stop strings, the occurrence that ends first ends the output (on a tie, the longer)."""
    assert run(["world", "lo w"], ["hello world"])[:2] == ("hel", "lo w")
    assert run(["a", "xaa"], ["xaa"])[:2] == ("x", "a")
    assert run(["b", "ab"], ["xab"])[:2] == ("x", "ab")


def test_no_stops_passes_through():
    """Without stop strings every delta is emitted unchanged."""
    assert run([], ["a", "b"])[2] == ["a", "b", ""]


def test_empty_stop_rejected():
    """An empty stop string is a configuration error."""
    with pytest.raises(ValueError):
        StopStringMatcher([""])


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="ab\n", min_size=0, max_size=40), st.lists(st.text(alphabet="ab\n", min_size=1, max_size=3), min_size=1, max_size=3),
       st.lists(st.integers(1, 5), min_size=1, max_size=40))
def test_matches_whole_string_search(text, stops, cuts):
    """For any split of the text into deltas, the output equals the text cut before the stop occurrence
    that ends first (ties: the one starting first), i.e. the result does not depend on the split."""
    deltas, position = [], 0
    for cut in cuts:
        deltas.append(text[position:position + cut])
        position += cut
    deltas.append(text[position:])
    hits = [(text.find(s) + len(s), text.find(s)) for s in stops if s in text]
    expected = text[: min(hits)[1]] if hits else text
    out, matched, _ = run(stops, deltas)
    assert out == expected
    assert (matched is not None) == bool(hits)
