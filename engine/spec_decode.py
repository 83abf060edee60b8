"""Speculative decoding around the engine's decode step: the draft proposes a block per sequence,
one target forward scores every sequence's [last token + drafts], and verification keeps the target
distribution exactly (greedy: longest matching prefix + bonus; sampled: rejection sampling).

Everything is computed on the logits' device; the host sees the draft tokens (one copy: it builds
the verify plan from them) and the verify verdicts (returned as a device tensor, fetched by the
engine together with the step's other sampled ids)."""
from __future__ import annotations

import torch

from engine.host_fetch import fetch_to_host
from engine.sampling import SamplingBatch, sample
from engine.sequence import Sequence
from engine.spec_verify import VerifyResult, verify_greedy_tensors, verify_sampled_tensors
from engine.step_plan import DraftPlan

# request id -> (draft tokens, their draft distribution q [k, vocab] when the request samples)
Proposals = dict[str, tuple[list[int], torch.Tensor | None]]


def _markov_drafts(logits: torch.Tensor, last: list[int], markov, choose) -> tuple[torch.Tensor, torch.Tensor]:
    """DSpark: drafts formed left to right with the Markov bias (K3_SPEC 5.3 step 3).
    logits [n, k, vocab] base; markov(prev [n]) -> [n, vocab], called once per slot in order (a MarkovSteps:
    it knows the slot's hidden state and carries an rnn head's state); choose(rows [n, vocab]) -> (tokens [n],
    q or None). -> (tokens [n, k], the Markov-corrected rows the tokens were chosen from [n, k, vocab] (q when
    sampled))."""
    prev = torch.tensor(last, dtype=torch.int64, device=logits.device)
    tokens, rows = [], []
    for k in range(logits.shape[1]):
        corrected = logits[:, k].float() + markov(prev)[:, : logits.shape[-1]]
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
    )
    out = execute(plan)
    logits, hidden = out if isinstance(out, tuple) else (out, None)
    logits = logits.view(len(group), block - 1, -1)
    if hidden is not None:
        hidden = hidden.view(len(group), block - 1, -1)

    def steps(rows: list[int]):
        return markov.steps(hidden[rows] if hidden is not None else None)

    active = [(i, seq, max(0, remaining[i])) for i, seq in enumerate(group) if remaining[i] > 0]
    greedy = [(i, seq, count) for i, seq, count in active if seq.params.greedy]
    sampled = [(i, seq, count) for i, seq, count in active if not seq.params.greedy]
    pieces, q = [], None
    if greedy and markov is not None:
        rows = [i for i, _, _ in greedy]
        picked, _ = _markov_drafts(logits[rows], [s.last_token for _, s, _ in greedy], steps(rows),
                                   lambda corrected: (corrected.argmax(dim=-1), None))
        pieces.append(torch.cat([picked[j, :count] for j, (_, _, count) in enumerate(greedy)]))
    elif greedy:
        pieces.append(torch.cat([logits[i, :count].argmax(dim=-1) for i, _, count in greedy]))
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
        return {}
    tokens = fetch_to_host(torch.cat(pieces))
    proposals: Proposals = {}
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


def verify_on_device(
    seqs: list[Sequence], proposals: Proposals, logits: torch.Tensor, offsets: list[int]
) -> tuple[list[int], torch.Tensor | None]:
    """logits: the target's rows for every sequence's [last token + drafts] (sequence i owns rows
    offsets[i]:offsets[i + 1]). -> (indices of the sequences with drafts, in verdict order;
    verdict [2 * n] int64 on the device: n accept counts, then n final tokens), nothing fetched."""
    spec = [i for i, seq in enumerate(seqs) if seq.request_id in proposals]
    greedy = [i for i in spec if seqs[i].params.greedy]
    sampled = [i for i in spec if not seqs[i].params.greedy]
    device = logits.device
    accepted, finals = [], []
    if greedy:
        _, num_accepted, final = verify_greedy_tensors(
            [torch.tensor(proposals[seqs[i].request_id][0], device=device) for i in greedy],
            [logits[offsets[i] : offsets[i + 1]] for i in greedy],
        )
        accepted.append(num_accepted)
        finals.append(final)
    if sampled:
        counts = [offsets[i + 1] - offsets[i] for i in sampled]
        rows = torch.cat([torch.arange(offsets[i], offsets[i + 1]) for i in sampled]).to(device)
        target = SamplingBatch.from_params([seqs[i].params for i in sampled], device=device).repeat_rows(counts).probs(
            logits.index_select(0, rows)
        )
        _, num_accepted, final = verify_sampled_tensors(
            [torch.tensor(proposals[seqs[i].request_id][0], device=device) for i in sampled],
            [proposals[seqs[i].request_id][1] for i in sampled],
            list(torch.split(target, counts)),
            [seqs[i].generator for i in sampled],
        )
        accepted.append(num_accepted)
        finals.append(final)
    if not spec:
        return [], None
    return greedy + sampled, torch.cat(accepted + finals)


def verdicts(seqs: list[Sequence], proposals: Proposals, order: list[int], values: list[int]) -> dict[int, VerifyResult]:
    """The host copy of verify_on_device's verdict -> {sequence index: tokens to append}."""
    count = len(order)
    results: dict[int, VerifyResult] = {}
    for j, i in enumerate(order):
        accepted, final = values[j], values[count + j]
        drafts = proposals[seqs[i].request_id][0]
        results[i] = VerifyResult(list(drafts[:accepted]) + [final], accepted)
    return results


def verify(seqs: list[Sequence], proposals: Proposals, logits: torch.Tensor, offsets: list[int]) -> dict[int, VerifyResult]:
    """verify_on_device + its fetch: for each index of a sequence with drafts, what to append."""
    order, verdict = verify_on_device(seqs, proposals, logits, offsets)
    return verdicts(seqs, proposals, order, fetch_to_host(verdict)) if verdict is not None else {}
