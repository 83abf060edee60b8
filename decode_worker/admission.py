"""Pure rules of the decode worker: what a reservation may take, and how engine outputs become stream updates."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from engine.runtime.sequence import TokenLogprob


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


def growth_pages(spec_block_size: int, page_size: int) -> int:
    """Pages one running request may need for its next step: a speculative block (+ the bonus token)
    can cross a page boundary, so one more than the block spans."""
    return pages_for(spec_block_size + 1, page_size) + 1


def headroom(running: int, spec_block_size: int, page_size: int) -> int:
    """Free pages kept back for the running requests to grow."""
    return running * growth_pages(spec_block_size, page_size)


def admits(free_pages: int, num_prompt_tokens: int, running: int, spec_block_size: int, page_size: int) -> bool:
    """Whether a reservation for the prompt leaves the running requests their headroom."""
    return free_pages - pages_for(num_prompt_tokens, page_size) >= headroom(running, spec_block_size, page_size)


def fits_ever(num_prompt_tokens: int, max_new_tokens: int, spec_block_size: int, page_size: int, total_pages: int) -> bool:
    """Whether the request's worst case (whole output plus one block in flight) fits an empty pool."""
    return pages_for(num_prompt_tokens + max_new_tokens + spec_block_size, page_size) <= total_pages


class EngineOutput(Protocol):
    """One request's part of an engine step: an engine.StepOutput, or the engine process's WireOutput."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    logprobs: list[TokenLogprob]


@dataclass(frozen=True)
class DecodeUpdate:
    """Tokens generated since the previous update (the first token, produced by prefill, excluded)."""

    token_ids: list[int]
    logprobs: list[TokenLogprob]
    finished: bool
    finish_reason: str | None
    steps: int  # engine steps that produced these tokens


def new_tokens(outputs: Sequence[EngineOutput], skip_first_token: bool) -> int:
    """How many tokens merge_outputs(outputs, skip_first_token) would carry."""
    count = sum(len(output.new_token_ids) for output in outputs)
    return count - 1 if skip_first_token and count else count


def merge_outputs(outputs: Sequence[EngineOutput], skip_first_token: bool) -> DecodeUpdate:
    """Merges one request's StepOutputs (in order) into one update. skip_first_token: drop the first token
    of the first non-empty output (add_prefilled re-emits the token prefill already returned). The
    engine gives no logprob for that token, so logprobs need no trimming."""
    tokens: list[int] = []
    logprobs: list[TokenLogprob] = []
    finished, reason = False, None
    for output in outputs:
        new = list(output.new_token_ids)
        if skip_first_token and new:
            new, skip_first_token = new[1:], False
        tokens += new
        logprobs += list(output.logprobs or [])
        finished, reason = output.finished, output.finish_reason
    return DecodeUpdate(tokens, logprobs, finished, reason, steps=len(outputs))


def merge_updates(updates: Sequence[DecodeUpdate]) -> DecodeUpdate:
    """Consecutive updates of one request as one (a DecodeStream writer fell behind the engine): tokens and
    logprobs in order, steps summed, the last update's finish (only the last may be finished)."""
    if len(updates) == 1:
        return updates[0]
    last = updates[-1]
    return DecodeUpdate([token for update in updates for token in update.token_ids],
                        [logprob for update in updates for logprob in update.logprobs],
                        last.finished, last.finish_reason, sum(update.steps for update in updates))
