"""Incremental detokenization that never emits a broken UTF-8 character.

A byte-level tokenizer may split one character over several tokens; decoding tokens that end inside the
character yields U+FFFD at the end of the text. So the decoder keeps a small window of recent tokens,
decodes it after each addition and emits only the new text before any trailing U+FFFD; the bytes of the
incomplete character stay in the window and are decoded again with the next tokens. Once the window
decodes cleanly it slides forward (keeping a few tokens as left context), so the work per token does not
grow with the output, and the concatenated deltas equal the decoded text."""
from __future__ import annotations

from typing import Protocol

REPLACEMENT = "\ufffd"
# Tokens kept as left context (tokenizers that drop a leading space need it); prompt tokens start it.
CONTEXT_TOKENS = 4


class Decoder(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, decoder: Decoder, prompt_ids: list[int] | tuple[int, ...] = (),
                 skip_special_tokens: bool = True) -> None:
        self._decoder = decoder
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-CONTEXT_TOKENS:]) if prompt_ids else []
        self._start = 0  # first token of the window
        self._done = len(self._decode())  # characters of the window text already emitted (or context)

    def _decode(self) -> str:
        return self._decoder.decode(self._ids[self._start:], skip_special_tokens=self._skip)

    def _advance(self, final: bool) -> str:
        window = self._decode()
        complete = not window.endswith(REPLACEMENT)
        safe = window if (complete or final) else window.rstrip(REPLACEMENT)
        delta = safe[self._done:] if len(safe) > self._done else ""
        self._done = max(self._done, len(safe))
        if complete and len(self._ids) - self._start > CONTEXT_TOKENS:
            self._start = len(self._ids) - CONTEXT_TOKENS
            self._done = len(self._decode())
        return delta

    def add(self, token_ids: list[int]) -> str:
        """Text made complete by these tokens (possibly empty)."""
        self._ids.extend(token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character decodes to U+FFFD here)."""
        return self._advance(final=True)
