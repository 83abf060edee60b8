"""Structured outputs' grammars: a request's (kind, text) - a JSON schema, any JSON object, a regex, a Lark grammar
or a choice among strings - compiled by llguidance for one tokenizer. Torch-free: the gateway checks requests'
grammars with it before any work; the engine's matchers and masks are in engine/sampling/grammar.py.

Why llguidance (over xgrammar): a 3 MB wheel with no dependencies (xgrammar pulls torch, transformers,
triton and apache-tvm-ffi), CPU wheels for every Python from 3.9 (abi3), grammars compiled lazily in
about a millisecond (no per-schema precompilation), ~0.1-0.3 ms per mask for the embedded models here, and
it is what vLLM uses by default for JSON schemas with features xgrammar lacks."""
from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from engine.sampling_params import GRAMMAR_KINDS

_JSON_OBJECT = '{"type": "object"}'
# JSON in one line with ", " and ": " separators (a schema's own "x-guidance" options still apply): small
# models otherwise spend their tokens on whitespace, which a flexible-whitespace grammar allows everywhere
_JSON_OPTIONS = {"whitespace_flexible": False}


class GrammarError(ValueError):
    """A grammar that does not compile; the message names the problem."""


def _llguidance() -> Any:
    import llguidance  # lazy: the engine imports without it; only structured requests need it

    return llguidance


def grammar_text(kind: str, text: str) -> str:
    """(kind, text) -> llguidance's grammar definition (GrammarError when the text itself is malformed)."""
    matcher = _llguidance().LLMatcher
    if kind == "json_object":
        return matcher.grammar_from_json_schema(_JSON_OBJECT, defaults=_JSON_OPTIONS)
    if kind == "json_schema":
        try:
            schema = json.loads(text)
        except ValueError as error:
            raise GrammarError(f"json_schema is not valid JSON: {error}") from None
        if not isinstance(schema, dict):
            raise GrammarError("json_schema must be a JSON object")
        return matcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
    if kind == "regex":
        return matcher.grammar_from_regex(text)
    if kind == "grammar":
        return matcher.grammar_from_lark(text)
    if kind == "choice":
        try:
            options = json.loads(text)
        except ValueError:
            options = None
        if not isinstance(options, list) or not options or not all(isinstance(o, str) for o in options):
            raise GrammarError("choice must be a non-empty list of strings")
        return _llguidance().grammar_from("choice", json.dumps(options))
    raise GrammarError(f"unknown structured output kind {kind!r}; one of {', '.join(GRAMMAR_KINDS)}")


class GrammarCompiler:
    """Compiles requests' grammars for one tokenizer (tokenizer.json text), vocabulary and eos tokens."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: Sequence[int]) -> None:
        self.vocab_size = vocab_size
        llguidance = _llguidance()
        self._tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_ids)[:1] or None)
        self._grammar = functools.lru_cache(maxsize=256)(grammar_text)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, vocab_size: int, eos_ids: Sequence[int]) -> GrammarCompiler:
        path = Path(model_dir, "tokenizer.json")
        if not path.is_file():
            raise GrammarError(f"structured outputs need the model's tokenizer.json; {model_dir} has none")
        return cls(path.read_text(), vocab_size, eos_ids)

    def check(self, kind: str, text: str) -> None:
        """GrammarError naming the problem when (kind, text) does not compile."""
        error = _llguidance().LLMatcher.validate_grammar(self._grammar(kind, text), self._tokenizer)
        if error:
            raise GrammarError(f"{kind}: {error.strip()}")

    def new_matcher(self, kind: str, text: str) -> Any:
        """A fresh llguidance.LLMatcher for (kind, text) (GrammarError when it does not compile)."""
        matcher = _llguidance().LLMatcher(self._tokenizer, self._grammar(kind, text), log_level=0)
        if matcher.is_error():
            raise GrammarError(f"{kind}: {matcher.get_error()}")
        return matcher


@functools.lru_cache(maxsize=8)
def compiler_for(model_dir: str, vocab_size: int, eos_ids: tuple[int, ...]) -> GrammarCompiler:
    """One compiler per model (building the tokenizer's tables takes ~50 ms)."""
    return GrammarCompiler.from_model_dir(model_dir, vocab_size, eos_ids)
