"""Prompt scoring: the log-probability of every prompt token after the first (and the most likely
alternatives at its position) from the prefill forward's own logits - no second pass. A prefill chunk
that asks for them returns the logits of all its rows; row p (prompt position p) predicts token p + 1."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.runtime.sequence import TokenLogprob
from engine.runtime.step_plan import PrefillItem
from engine.runtime.step_results import token_logprobs


def logit_spans(items: Sequence[PrefillItem]) -> list[tuple[int, int]]:
    """Per item of a prefill plan, (first row, row count) of its rows in the forward's logits (prefill_plan:
    every row of an all_logits item, else the last row of an item that needs logits, else none)."""
    spans, row = [], 0
    for item in items:
        count = item.num_tokens if item.all_logits else int(item.needs_logits)
        spans.append((row, count))
        row += count
    return spans


def prompt_token_logprobs(logits: torch.Tensor, prompt_ids: Sequence[int], start: int, num_top: int) -> list[TokenLogprob]:
    """logits: [count, V], the rows of prompt positions start .. start + count - 1 -> the logprobs of prompt
    tokens start + 1 .. (the prompt's last token at most), each with num_top alternatives (raw distribution)."""
    end = min(start + logits.shape[0], len(prompt_ids) - 1)
    if end <= start:
        return []
    return token_logprobs(logits[: end - start], list(prompt_ids[start + 1 : end + 1]), num_top)
