"""The scores a step samples from: the target's raw logits with each request's adjustments
(engine/penalties.py) and grammar mask (engine/grammar.py) for the position each row samples. Logprobs stay
those of the raw logits.

Row contexts: a first token (prefill) follows the prompt alone; a decode row follows the committed tokens;
verify row j of a drafted sequence follows the committed tokens + drafts[:j], so the verifier sees at
every position the distribution autoregressive decoding would have sampled there."""
from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence as Seq

import torch

from engine.penalties import RowContext, adjust_logits, needs_adjustment
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence


def apply_masks(scores: torch.Tensor, masks: Mapping[int, torch.Tensor], eos_ids: Collection[int]) -> torch.Tensor:
    """scores: [N, V]; masks: first row -> [k, V] bool (rows first .. first + k - 1 may only take the allowed tokens)
    -> [N, V] float32 with the others at -inf. A row that allows nothing (a failed matcher) allows eos, which ends
    the request."""
    if not masks:
        return scores
    allowed = torch.ones(scores.shape, dtype=torch.bool)
    for first, rows in masks.items():
        allowed[first : first + rows.shape[0]] = rows
    empty = ~allowed.any(dim=1)
    if empty.any() and eos_ids:
        allowed[empty, min(eos_ids)] = True
    return scores.float().masked_fill(~allowed.to(scores.device), float("-inf"))


def first_token_scores(params: Seq[SamplingParams], prompts: Seq[Seq[int]], logits: torch.Tensor,
                       eos_ids: Collection[int], matchers: Seq[object | None] = ()) -> torch.Tensor:
    """logits: [len(params), V], row i the last prompt position of prompts[i]; matchers: per row a GrammarMatcher
    (or None) in its start state -> the scores to sample from."""
    rows = [RowContext(p, prompt, ()) if needs_adjustment(p) else None for p, prompt in zip(params, prompts)]
    masks = {i: m.allowed().unsqueeze(0) for i, m in enumerate(matchers) if m is not None}  # type: ignore[attr-defined]
    return apply_masks(adjust_logits(logits, rows, eos_ids), masks, eos_ids)


def step_scores(seqs: Seq[Sequence], drafts: Mapping[str, Seq[int]], logits: torch.Tensor, offsets: Seq[int],
                eos_ids: Collection[int]) -> torch.Tensor:
    """logits: a decode / verify forward's rows (sequence i owns offsets[i]:offsets[i + 1]: its last token, then
    its drafts) -> the same rows adjusted and masked; `logits` itself when no sequence asks for either."""
    rows: list[RowContext | None] = [None] * (offsets[-1] if offsets else 0)
    masks: dict[int, torch.Tensor] = {}
    for i, seq in enumerate(seqs):
        proposed = list(drafts.get(seq.request_id, ()))[: offsets[i + 1] - offsets[i] - 1]
        if seq.grammar is not None:
            masks[offsets[i]] = seq.grammar.draft_masks(proposed)
        if not needs_adjustment(seq.params):
            continue
        prompt, generated = seq.token_ids[: seq.prompt_len], seq.token_ids[seq.prompt_len :]
        for j in range(offsets[i + 1] - offsets[i]):
            rows[offsets[i] + j] = RowContext(seq.params, prompt, generated + proposed[:j])
    return apply_masks(adjust_logits(logits, rows, eos_ids), masks, eos_ids)
