"""Logit adjustments that depend on a request's settings and on the tokens before the position being
sampled: logit_bias, min_tokens, presence / frequency / repetition penalties. Pure functions over
tensors; the engine applies them to the target's logits rows before sampling or verification, so a
speculative verify row j sees the penalties of the committed tokens plus drafts[:j] (the same
adjusted distribution autoregressive decoding would sample from: exact).

Semantics (vLLM's, which follow OpenAI's for the first two):
  presence_penalty  p: logit -= p for every token generated at least once;
  frequency_penalty f: logit -= f * (times generated);
  repetition_penalty r (CTRL, over prompt + generated): a seen token's logit is divided by r when
    positive, multiplied by r when negative;
order: logit_bias and min_tokens first, then repetition, then frequency and presence.
logit_bias: bias added to the token's logit; a bias of -100 (the floor) bans the token outright (its
logit becomes -inf), as OpenAI documents it ("should result in a ban").
min_tokens: while fewer than min_tokens tokens were generated, eos (unless ignore_eos) and
stop_token_ids are banned."""
from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import NamedTuple

import torch

from engine.sampling_params import SamplingParams

BAN_BIAS = -100.0  # a logit_bias this low bans the token


class RowContext(NamedTuple):
    """What the row's adjustment depends on: the request's settings, its prompt and the tokens generated
    before the position this row samples (committed tokens, then any drafts verified before it)."""

    params: SamplingParams
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]


def needs_adjustment(params: SamplingParams) -> bool:
    """Whether any of this module's adjustments changes the request's logits."""
    return bool(params.logit_bias or params.min_tokens or params.presence_penalty or params.frequency_penalty
                or params.repetition_penalty != 1.0)


def token_counts(histories: Sequence[Sequence[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """histories: per row, token ids -> [rows, vocab] float32 counts (how often each id occurs in the row)."""
    counts = torch.zeros((len(histories), vocab_size), dtype=torch.float32, device=device)
    rows = [row for row, ids in enumerate(histories) for _ in ids]
    if rows:
        ids = [token for history in histories for token in history]
        index = (torch.tensor(rows, device=device), torch.tensor(ids, device=device))
        counts.index_put_(index, torch.ones(len(ids), device=device), accumulate=True)
    return counts


def apply_penalties(logits: torch.Tensor, output_counts: torch.Tensor, prompt_mask: torch.Tensor,
                    presence: torch.Tensor, frequency: torch.Tensor, repetition: torch.Tensor) -> torch.Tensor:
    """logits: [N, V] float; output_counts: [N, V] generated-token counts; prompt_mask: [N, V] bool, token in
    the prompt; presence, frequency, repetition: [N] -> [N, V] penalised logits (a new tensor)."""
    seen = prompt_mask | (output_counts > 0)
    rep = repetition.to(logits.dtype).unsqueeze(1)
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    logits = logits - frequency.to(logits.dtype).unsqueeze(1) * output_counts
    return logits - presence.to(logits.dtype).unsqueeze(1) * (output_counts > 0).to(logits.dtype)


def _bias_and_bans(params: SamplingParams, num_generated: int, eos_ids: Collection[int]) -> tuple[list[int], list[float]]:
    """(token ids, additive values) for this row's logit_bias and min_tokens bans (-inf for a ban)."""
    ids, values = [], []
    for token, bias in params.logit_bias:
        ids.append(token)
        values.append(float("-inf") if bias <= BAN_BIAS else float(bias))
    if num_generated < params.min_tokens:
        banned = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
        ids.extend(sorted(banned))
        values.extend([float("-inf")] * len(banned))
    return ids, values


def adjust_logits(logits: torch.Tensor, rows: Sequence[RowContext | None], eos_ids: Collection[int]) -> torch.Tensor:
    """logits: [N, V], rows: one RowContext per row (None: leave the row alone) -> [N, V] float32 logits with
    each row's adjustments applied; `logits` itself when no row needs any (nothing copied)."""
    active = [index for index, row in enumerate(rows) if row is not None and needs_adjustment(row.params)]
    if not active:
        return logits
    device, vocab = logits.device, logits.shape[-1]
    index = torch.tensor(active, device=device)
    picked = logits.index_select(0, index).float()
    contexts = [rows[i] for i in active]
    bias_rows, bias_ids, bias_values = [], [], []
    for row, context in enumerate(contexts):
        assert context is not None
        ids, values = _bias_and_bans(context.params, len(context.output_ids), eos_ids)
        bias_rows.extend([row] * len(ids))
        bias_ids.extend(ids)
        bias_values.extend(values)
    if bias_ids:
        bias = torch.zeros_like(picked)
        bias.index_put_((torch.tensor(bias_rows, device=device), torch.tensor(bias_ids, device=device)),
                        torch.tensor(bias_values, device=device), accumulate=True)
        picked = picked + bias
    penalised = [row for row, context in enumerate(contexts)
                 if context.params.presence_penalty or context.params.frequency_penalty
                 or context.params.repetition_penalty != 1.0]
    if penalised:
        chosen = [contexts[row] for row in penalised]
        sub = torch.tensor(penalised, device=device)
        counts = token_counts([c.output_ids for c in chosen], vocab, device)
        in_prompt = token_counts([c.prompt_ids if c.params.repetition_penalty != 1.0 else () for c in chosen],
                                 vocab, device) > 0

        def column(name: str) -> torch.Tensor:
            return torch.tensor([getattr(c.params, name) for c in chosen], dtype=torch.float32, device=device)

        picked[sub] = apply_penalties(picked.index_select(0, sub), counts, in_prompt, column("presence_penalty"),
                                      column("frequency_penalty"), column("repetition_penalty"))
    out = logits.float().clone()
    out[index] = picked
    return out
