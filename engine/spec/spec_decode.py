"""Speculative decoding around the engine's decode step: the draft proposes a block per sequence,
one target forward scores every sequence's [last token + drafts], and verification keeps the target
distribution exactly (greedy: longest matching prefix + bonus; sampled: rejection sampling).

Everything is computed on the logits' device; the host sees the draft tokens (one copy: it builds
the verify plan from them) and the verify verdicts (returned as a device tensor, fetched by the
engine together with the step's other sampled ids)."""
from __future__ import annotations

from typing import NamedTuple

import torch

from engine.runtime.devices import host_to_device
from engine.sampling.grammar import constrained_drafts
from engine.runtime.host_fetch import fetch_to_host
from engine.sampling.ops import SamplingBatch, sample
from engine.runtime.sequence import Sequence
from engine.spec.spec_verify import VerifyResult, verify_sampled
from engine.runtime.step_plan import DraftPlan

# request id -> (draft tokens, their draft distribution q [k, vocab] when the request samples)
Proposals = dict[str, tuple[list[int], torch.Tensor | None]]


def _markov_drafts(logits: torch.Tensor, last: list[int], markov, choose) -> tuple[torch.Tensor, torch.Tensor]:
    """DSpark: drafts formed left to right with the Markov bias (K3_SPEC 5.3 step 3).
    logits [n, k, vocab] base; markov(prev [n]) -> [n, vocab], called once per slot in order (a MarkovSteps:
    it knows the slot's hidden state and carries an rnn head's state); choose(rows [n, vocab]) -> (tokens [n],
    q or None). -> (tokens [n, k], the Markov-corrected rows the tokens were chosen from [n, k, vocab] (q when
    sampled))."""
    prev = host_to_device(last, torch.int64, logits.device)
    vocab = logits.shape[-1]
    corrected_of = getattr(markov, "corrected", None)  # a MarkovSteps adds its bias in one fused op
    tokens, rows = [], []
    for k, base in enumerate(logits.float().unbind(1)):
        corrected = corrected_of(base, prev) if corrected_of is not None else base + markov(prev)[:, :vocab]
        prev, q = choose(corrected)
        tokens.append(prev)
        rows.append(corrected if q is None else q)
    return torch.stack(tokens, dim=1), torch.stack(rows, dim=1)


def propose(execute, block: int, group: list[Sequence], markov=None) -> Proposals:
    """Runs the draft once for sequences sharing a block size. execute(plan) -> draft logits
    [len(group) * (block - 1), vocab] (and hidden rows when the plan asks for them). Sequences near
    max_new_tokens get fewer drafts; none with 0. markov: a DSpark draft's Markov head
    (engine/models/dspark_markov.py), applied left to right; None for a DFlash draft."""
    remaining = [min(block - 1, s.params.max_new_tokens - s.num_generated) for s in group]
    plan = DraftPlan(
        block_size=block,
        last_tokens=[s.last_token for s in group],
        context_lens=[s.num_cached for s in group],
        page_tables=[list(s.page_table.pages) for s in group],
        with_hidden=bool(markov is not None and markov.needs_hidden),
        seq_keys=tuple(s.request_id for s in group),
    )
    out = execute(plan)
    logits, hidden = out if isinstance(out, tuple) else (out, None)
    logits = logits.view(len(group), block - 1, -1)
    if hidden is not None:
        hidden = hidden.view(len(group), block - 1, -1)

    def steps(rows: list[int]):
        return markov.steps(hidden[rows] if hidden is not None else None)

    active = [(i, seq, max(0, remaining[i])) for i, seq in enumerate(group) if remaining[i] > 0]
    proposals: Proposals = {}
    if markov is None:  # structured outputs: drafts chosen within the grammar (engine/sampling/grammar.py), left to right;
        for i, seq, count in active:  # none when the grammar allows nothing more (then a plain step)
            if seq.grammar is not None and (drafted := _constrained(seq, logits[i, :count]))[0]:
                proposals[seq.request_id] = drafted
        active = [(i, seq, count) for i, seq, count in active if seq.grammar is None]
    greedy = [(i, seq, count) for i, seq, count in active if seq.params.greedy]
    sampled = [(i, seq, count) for i, seq, count in active if not seq.params.greedy]
    pieces, q = [], None
    if greedy and markov is not None:
        rows = [i for i, _, _ in greedy]
        base, last = (logits if len(rows) == len(group) else logits[rows]), [s.last_token for _, s, _ in greedy]
        picked = markov.greedy_drafts(base.float(), host_to_device(last, torch.int64, base.device)) \
            if hasattr(markov, "greedy_drafts") else None  # one fused call (CPU, vanilla head)
        if picked is None:
            picked, _ = _markov_drafts(base, last, steps(rows), lambda corrected: (corrected.argmax(dim=-1), None))
        pieces.append(torch.cat([picked[j, :count] for j, (_, _, count) in enumerate(greedy)]))
    elif greedy:  # one argmax over the whole block; the common case (all greedy, all full) needs no gather
        top = logits.argmax(dim=-1)
        full = len(greedy) == len(group) and all(count == block - 1 for _, _, count in greedy)
        pieces.append(top.view(-1) if full else torch.cat([top[i, :count] for i, _, count in greedy]))
    if sampled:
        batch = SamplingBatch.from_params(
            [seq.params for _, seq, _ in sampled], [seq.generator for _, seq, _ in sampled], device=logits.device
        )
        if markov is not None:
            def choose(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                probs = batch.probs(rows)
                return sample(probs, batch.generators), probs

            rows = [i for i, _, _ in sampled]
            picked, probs = _markov_drafts(logits[rows], [s.last_token for _, s, _ in sampled], steps(rows), choose)
            q = torch.cat([probs[j, :count] for j, (_, _, count) in enumerate(sampled)])
            pieces.append(torch.cat([picked[j, :count] for j, (_, _, count) in enumerate(sampled)]))
        else:
            repeated = batch.repeat_rows([count for _, _, count in sampled])
            q = repeated.probs(torch.cat([logits[i, :count] for i, _, count in sampled]))
            pieces.append(sample(q, repeated.generators))
    if not pieces:
        return proposals
    tokens = fetch_to_host(torch.cat(pieces))
    start = 0
    for _, seq, count in greedy:
        proposals[seq.request_id] = (tokens[start : start + count], None)
        start += count
    q_start = 0
    for _, seq, count in sampled:
        proposals[seq.request_id] = (tokens[start : start + count], q[q_start : q_start + count])
        start += count
        q_start += count
    return proposals


def _constrained(seq: Sequence, logits: torch.Tensor) -> tuple[list[int], torch.Tensor | None]:
    """One grammar-constrained sequence's drafts (and q when it samples) from its draft rows [count, V]."""
    if seq.params.greedy:
        tokens, _ = constrained_drafts(seq.grammar, logits, lambda row: (int(row.argmax()), None))
        return tokens, None
    batch = SamplingBatch.from_params([seq.params], [seq.generator], device=logits.device)

    def choose(row: torch.Tensor) -> tuple[int, torch.Tensor]:
        probs = batch.probs(row)
        return int(sample(probs, batch.generators)[0]), probs[0]

    tokens, rows = constrained_drafts(seq.grammar, logits, choose)
    return tokens, torch.stack(rows) if rows else None


class VerifyOrder(NamedTuple):
    """Which sequences verify_on_device put where in its device tensor: greedy[j] owns counts[j] argmax rows
    (its drafts + 1, back to back, first), then sampled[j] its accept count and after those its final token."""

    greedy: list[int]
    counts: list[int]
    sampled: list[int]


def verify_on_device(
    seqs: list[Sequence], proposals: Proposals, logits: torch.Tensor, offsets: list[int]
) -> tuple[VerifyOrder, torch.Tensor | None]:
    """logits: the target's rows for every sequence's [last token + drafts] (sequence i owns rows
    offsets[i]:offsets[i + 1]). -> (where each drafted sequence's verdict sits; the verdict, int64 on the
    device: the target's argmax of every greedy sequence's rows (its acceptance is a prefix comparison the
    host does on the fetched ids), then the sampled sequences' accept counts and final tokens), nothing fetched."""
    spec = [i for i, seq in enumerate(seqs) if seq.request_id in proposals]
    greedy = [i for i in spec if seqs[i].params.greedy]
    sampled = [i for i in spec if not seqs[i].params.greedy]
    device = logits.device
    pieces = []
    if greedy:
        if len(greedy) == len(seqs):
            pieces.append(logits.argmax(dim=-1))
        else:
            rows = [r for i in greedy for r in range(offsets[i], offsets[i + 1])]
            pieces.append(logits.index_select(0, host_to_device(rows, torch.int64, device)).argmax(dim=-1))
    if sampled:
        counts = [offsets[i + 1] - offsets[i] for i in sampled]
        rows = host_to_device([r for i in sampled for r in range(offsets[i], offsets[i + 1])], torch.int64, device)
        target = SamplingBatch.from_params([seqs[i].params for i in sampled], device=device).repeat_rows(counts).probs(
            logits.index_select(0, rows)
        )
        _, num_accepted, final = verify_sampled(
            [host_to_device(proposals[seqs[i].request_id][0], torch.int64, device) for i in sampled],
            [proposals[seqs[i].request_id][1] for i in sampled],
            list(torch.split(target, counts)),
            [seqs[i].generator for i in sampled],
        )
        pieces += [num_accepted, final]
    order = VerifyOrder(greedy, [offsets[i + 1] - offsets[i] for i in greedy], sampled)
    return order, torch.cat(pieces) if pieces else None


def greedy_verdict(drafts: list[int], argmax: list[int]) -> VerifyResult:
    """The longest prefix of drafts equal to the target's argmax rows, then the argmax after it (argmax has
    len(drafts) + 1 rows)."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == argmax[accepted]:
        accepted += 1
    return VerifyResult(list(drafts[:accepted]) + [argmax[accepted]], accepted)


def verdicts(seqs: list[Sequence], proposals: Proposals, order: VerifyOrder, values: list[int]) -> dict[int, VerifyResult]:
    """The host copy of verify_on_device's verdict -> {sequence index: tokens to append}."""
    results: dict[int, VerifyResult] = {}
    start = 0
    for i, count in zip(order.greedy, order.counts):
        results[i] = greedy_verdict(proposals[seqs[i].request_id][0], values[start : start + count])
        start += count
    count = len(order.sampled)
    for j, i in enumerate(order.sampled):
        accepted, final = values[start + j], values[start + count + j]
        results[i] = VerifyResult(list(proposals[seqs[i].request_id][0][:accepted]) + [final], accepted)
    return results


def verify(seqs: list[Sequence], proposals: Proposals, logits: torch.Tensor, offsets: list[int]) -> dict[int, VerifyResult]:
    """verify_on_device + its fetch: for each index of a sequence with drafts, what to append."""
    order, verdict = verify_on_device(seqs, proposals, logits, offsets)
    return verdicts(seqs, proposals, order, fetch_to_host(verdict)) if verdict is not None else {}
