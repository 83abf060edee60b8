"""Text-level stop strings over a stream of text deltas.

Text that could be the start of a stop string is held back until the next delta decides it, so the
emitted text never contains a stop string, nor any part of one that ends up matching. The stop that
matches is the occurrence that is complete first (earliest end; on a tie the longer one), which does not
depend on how the text was split into deltas."""
from __future__ import annotations

from typing import NamedTuple


class StopCheck(NamedTuple):
    text: str           # safe to emit now
    matched: str | None  # the stop string found (output ends before it), else None


class StopStringMatcher:
    def __init__(self, stops: tuple[str, ...] | list[str]) -> None:
        if any(not stop for stop in stops):
            raise ValueError("stop strings must be non-empty")
        self._stops = tuple(stops)
        self._pending = ""
        self.matched: str | None = None

    def feed(self, delta: str) -> StopCheck:
        if self.matched is not None:
            return StopCheck("", self.matched)
        if not self._stops:
            return StopCheck(delta, None)
        text = self._pending + delta
        first: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self._stops:
            index = text.find(stop)
            if index >= 0 and (first is None or (index + len(stop), index) < first[:2]):
                first = (index + len(stop), index, stop)
        if first is not None:
            self._pending = ""
            self.matched = first[2]
            return StopCheck(text[: first[1]], first[2])
        keep = self._partial_suffix(text)
        self._pending = text[len(text) - keep:] if keep else ""
        return StopCheck(text[: len(text) - keep], None)

    def _partial_suffix(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of some stop string."""
        longest = 0
        for stop in self._stops:
            for size in range(min(len(stop) - 1, len(text)), longest, -1):
                if stop.startswith(text[len(text) - size:]):
                    longest = size
                    break
        return longest

    def flush(self) -> str:
        """Held-back text when the output ended without a match."""
        text, self._pending = self._pending, ""
        return "" if self.matched is not None else text
