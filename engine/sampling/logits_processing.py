"""The scores a step samples from: the target's raw logits with each request's adjustments
(engine/sampling/penalties.py) and grammar mask (engine/sampling/grammar.py) for the position each row samples. Logprobs stay
those of the raw logits.

Row contexts: a first token (prefill) follows the prompt alone; a decode row follows the committed tokens;
verify row j of a drafted sequence follows the committed tokens + drafts[:j], so the verifier sees at
every position the distribution autoregressive decoding would have sampled there."""
from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence as Seq

import torch

from engine.sampling.grammar import unpack_bitmasks
from engine.sampling.penalties import RowContext, adjust_logits, needs_adjustment
from engine.sampling_params import SamplingParams
from engine.runtime.sequence import Sequence


def apply_masks(scores: torch.Tensor, masks: Mapping[int, torch.Tensor], eos_ids: Collection[int]) -> torch.Tensor:
    """scores: [N, V]; masks: first row -> [k, words] int32 grammar bitmasks (rows first .. first + k - 1 may only
    take the allowed tokens) -> [N, V] float32 with the others at -inf (all rows unpacked in one pass). A row that
    allows nothing (a failed matcher) allows eos, which ends the request."""
    if not masks:
        return scores
    rows = [first + j for first, words in masks.items() for j in range(words.shape[0])]
    allowed = unpack_bitmasks(torch.cat(list(masks.values())), scores.shape[-1])
    empty = ~allowed.any(dim=1)
    if eos_ids and bool(empty.any()):
        allowed[empty, min(eos_ids)] = True
    if rows == list(range(scores.shape[0])):  # every row masked (a batch of structured requests): one op
        return scores.float().masked_fill(~allowed.to(scores.device), float("-inf"))
    index = torch.tensor(rows, device=scores.device)
    out = scores.float().clone() if scores.dtype == torch.float32 else scores.float()
    out[index] = out.index_select(0, index).masked_fill(~allowed.to(scores.device), float("-inf"))
    return out


def first_token_scores(params: Seq[SamplingParams], prompts: Seq[Seq[int]], logits: torch.Tensor,
                       eos_ids: Collection[int], matchers: Seq[object | None] = ()) -> torch.Tensor:
    """logits: [len(params), V], row i the last prompt position of prompts[i]; matchers: per row a GrammarMatcher
    (or None) in its start state -> the scores to sample from."""
    rows = [RowContext(p, prompt, ()) if needs_adjustment(p) else None for p, prompt in zip(params, prompts)]
    masks = {i: m.bitmask().unsqueeze(0) for i, m in enumerate(matchers) if m is not None}  # type: ignore[attr-defined]
    return apply_masks(adjust_logits(logits, rows, eos_ids), masks, eos_ids)


def grammar_masks(seqs: Seq[Sequence], drafts: Mapping[str, Seq[int]], offsets: Seq[int]) -> dict[int, torch.Tensor]:
    """The grammar bitmasks of a decode / verify step's rows: first row of each structured sequence -> [rows, words]
    (row j after its drafts[:j]). Touches only the sequences' matchers, so it may run on another thread while the
    forward runs (llguidance drops the GIL while it computes a mask)."""
    return {offsets[i]: seq.grammar.draft_masks(list(drafts.get(seq.request_id, ()))[: offsets[i + 1] - offsets[i] - 1])
            for i, seq in enumerate(seqs) if seq.grammar is not None}


def step_scores(seqs: Seq[Sequence], drafts: Mapping[str, Seq[int]], logits: torch.Tensor, offsets: Seq[int],
                eos_ids: Collection[int], masks: Mapping[int, torch.Tensor] | None = None) -> torch.Tensor:
    """logits: a decode / verify forward's rows (sequence i owns offsets[i]:offsets[i + 1]: its last token, then
    its drafts) -> the same rows adjusted and masked; `logits` itself when no sequence asks for either. masks:
    grammar_masks of the step when computed already (None: computed here)."""
    rows: list[RowContext | None] = [None] * (offsets[-1] if offsets else 0)
    if masks is None:
        masks = grammar_masks(seqs, drafts, offsets)
    for i, seq in enumerate(seqs):
        proposed = list(drafts.get(seq.request_id, ()))[: offsets[i + 1] - offsets[i] - 1]
        if not needs_adjustment(seq.params):
            continue
        prompt, generated = seq.token_ids[: seq.prompt_len], seq.token_ids[seq.prompt_len :]
        for j in range(offsets[i + 1] - offsets[i]):
            rows[offsets[i] + j] = RowContext(seq.params, prompt, generated + proposed[:j])
    return apply_masks(adjust_logits(logits, rows, eos_ids), masks, eos_ids)
