"""Structured outputs in the engine: a request's grammar matcher (engine/sampling/grammar_compiler.py compiles it) tracks
the tokens generated so far and gives the tokens allowed next as a bitmask over the vocabulary.

Speculative decoding (engine/sampling/logits_processing.py): verify row j of a drafted sequence is masked by the
matcher's state after drafts[:j]: the drafts the grammar accepts are consumed one at a time to get each
row's mask, then rolled back; the engine consumes what verification keeps (engine.runtime.llm_engine
_append_tokens). A draft the grammar refuses has probability 0 under its row: it is rejected. The drafts
themselves are chosen within the grammar (constrained_drafts), so they are rarely refused."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine.sampling.grammar_compiler import GrammarCompiler


def new_matcher(compiler: GrammarCompiler, kind: str, text: str) -> GrammarMatcher:
    """A request's matcher in its start state (GrammarError when the grammar does not compile)."""
    return GrammarMatcher(compiler.new_matcher(kind, text), compiler.vocab_size)


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
