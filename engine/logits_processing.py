"""The scores a step samples from: the target's raw logits with each request's adjustments
(engine/penalties.py) for the position each row samples. Logprobs stay those of the raw logits.

Row contexts: a first token (prefill) follows the prompt alone; a decode row follows the committed tokens;
verify row j of a drafted sequence follows the committed tokens + drafts[:j], so the verifier sees at
every position the distribution autoregressive decoding would have sampled there."""
from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence as Seq

import torch

from engine.penalties import RowContext, adjust_logits, needs_adjustment
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence


def first_token_scores(params: Seq[SamplingParams], prompts: Seq[Seq[int]], logits: torch.Tensor,
                       eos_ids: Collection[int]) -> torch.Tensor:
    """logits: [len(params), V], row i the last prompt position of prompts[i] -> the scores to sample from."""
    rows = [RowContext(p, prompt, ()) if needs_adjustment(p) else None for p, prompt in zip(params, prompts)]
    return adjust_logits(logits, rows, eos_ids)


def step_scores(seqs: Seq[Sequence], drafts: Mapping[str, Seq[int]], logits: torch.Tensor, offsets: Seq[int],
                eos_ids: Collection[int]) -> torch.Tensor:
    """logits: a decode / verify forward's rows (sequence i owns offsets[i]:offsets[i + 1]: its last token, then
    its drafts) -> the same rows adjusted; `logits` itself when no sequence asks for an adjustment."""
    rows: list[RowContext | None] = [None] * (offsets[-1] if offsets else 0)
    for i, seq in enumerate(seqs):
        if not needs_adjustment(seq.params):
            continue
        prompt, generated = seq.token_ids[: seq.prompt_len], seq.token_ids[seq.prompt_len :]
        proposed = drafts.get(seq.request_id, ())
        for j in range(offsets[i + 1] - offsets[i]):
            rows[offsets[i] + j] = RowContext(seq.params, prompt, generated + list(proposed[:j]))
    return adjust_logits(logits, rows, eos_ids)
