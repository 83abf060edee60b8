"""Structured outputs: a request's grammar (a JSON schema, any JSON object, a regex, a Lark grammar or a
choice among strings) compiled by llguidance into a matcher that tracks the tokens generated so far and
gives the tokens allowed next as a mask over the vocabulary.

Why llguidance (over xgrammar): a 3 MB wheel with no dependencies (xgrammar pulls torch, transformers,
triton and apache-tvm-ffi), CPU wheels for every Python from 3.9 (abi3), grammars compiled lazily in
about a millisecond (no per-schema precompilation), ~0.1 ms per mask for the embedded models here, and
it is what vLLM uses by default for JSON schemas with features xgrammar lacks.

Speculative decoding (engine/logits_processing.py): verify row j of a drafted sequence is masked by the
matcher's state after drafts[:j]: the drafts the grammar accepts are consumed one at a time to get each
row's mask, then rolled back; the engine consumes what verification keeps (engine.llm_engine
_append_tokens). A draft the grammar refuses has probability 0 under its row: it is rejected."""
from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

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


@dataclass
class GrammarMatcher:
    """One request's matcher: the state after the tokens it consumed."""

    matcher: Any  # llguidance.LLMatcher
    vocab_size: int

    def bitmask(self) -> torch.Tensor:
        """[words] int32: the tokens the grammar allows next, one bit each (token t: bit t % 32 of word t // 32)."""
        return torch.frombuffer(bytearray(self.matcher.compute_bitmask()), dtype=torch.int32)

    def allowed(self) -> torch.Tensor:
        """[vocab] bool: the tokens the grammar allows next."""
        return unpack_bitmasks(self.bitmask().unsqueeze(0), self.vocab_size)[0]

    def consume(self, token: int) -> None:
        """Advance past a generated token (a token the grammar refuses leaves the matcher in its error state:
        is_stopped then reports it)."""
        if not self.matcher.is_stopped():
            self.matcher.consume_token(token)

    @property
    def is_stopped(self) -> bool:
        """The grammar is complete (only eos was allowed and came) or the matcher failed."""
        return self.matcher.is_stopped() or self.matcher.is_error()

    def draft_masks(self, drafts: Sequence[int]) -> torch.Tensor:
        """[len(drafts) + 1, words] int32 bitmasks: row j the tokens allowed after drafts[:j]. Drafts the grammar
        accepts are consumed to get there and rolled back; rows after a refused draft repeat the last mask
        (verification never reaches them: the refused draft has probability 0)."""
        masks = [self.bitmask()]
        valid = self.matcher.validate_tokens(list(drafts)) if drafts and not self.matcher.is_stopped() else 0
        for token in drafts[:valid]:
            self.matcher.consume_token(token)
            masks.append(self.bitmask() if not self.matcher.is_stopped() else torch.zeros_like(masks[0]))
        if valid:
            self.matcher.rollback(valid)
        masks.extend([masks[-1]] * (len(drafts) + 1 - len(masks)))
        return torch.stack(masks)


_BITS = torch.arange(32, dtype=torch.int32)


def unpack_bitmasks(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, words] int32 bitmasks -> [rows, vocab_size] bool, in one pass over every row."""
    return ((words.unsqueeze(-1) >> _BITS) & 1).flatten(1)[:, :vocab_size].bool()


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

    def matcher(self, kind: str, text: str) -> GrammarMatcher:
        llguidance = _llguidance()
        matcher = llguidance.LLMatcher(self._tokenizer, self._grammar(kind, text), log_level=0)
        if matcher.is_error():
            raise GrammarError(f"{kind}: {matcher.get_error()}")
        return GrammarMatcher(matcher, self.vocab_size)


@functools.lru_cache(maxsize=8)
def compiler_for(model_dir: str, vocab_size: int, eos_ids: tuple[int, ...]) -> GrammarCompiler:
    """One compiler per model (building the tokenizer's tables takes ~50 ms)."""
    return GrammarCompiler.from_model_dir(model_dir, vocab_size, eos_ids)


def constrained_drafts(matcher: GrammarMatcher, logits: torch.Tensor, choose) -> tuple[list[int], list[torch.Tensor]]:
    """A draft block chosen left to right within the grammar: logits [count, V] the draft's rows; choose(row [1, V]
    masked) -> (token, the distribution it was drawn from [V] or None for argmax). Stops early when the grammar
    allows nothing more; the matcher is left where it was. -> (tokens, their distributions q when sampled)."""
    tokens: list[int] = []
    rows: list[torch.Tensor] = []
    for j in range(logits.shape[0]):
        if matcher.is_stopped:
            break
        allowed = matcher.allowed()
        if not bool(allowed.any()):
            break
        masked = logits[j].float().masked_fill(~allowed.to(logits.device), float("-inf")).unsqueeze(0)
        token, q = choose(masked)
        tokens.append(token)
        if q is not None:
            rows.append(q)
        matcher.matcher.consume_token(token)
    if tokens:
        matcher.matcher.rollback(len(tokens))
    return tokens, rows
