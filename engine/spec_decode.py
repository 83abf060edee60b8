"""Speculative decoding around the engine's decode step: the draft proposes a block per sequence,
one target forward scores every sequence's [last token + drafts], and verification keeps the target
distribution exactly (greedy: longest matching prefix + bonus; sampled: rejection sampling)."""
from __future__ import annotations

import torch

from engine.sampling import SamplingBatch, sample
from engine.sequence import Sequence
from engine.spec_verify import VerifyResult, verify_greedy, verify_sampled
from engine.step_plan import DraftPlan

# request id -> (draft tokens, their draft distribution q [k, vocab] when the request samples)
Proposals = dict[str, tuple[list[int], torch.Tensor | None]]


def propose(execute, block: int, group: list[Sequence]) -> Proposals:
    """Runs the draft once for sequences sharing a block size. execute(plan) -> draft logits
    [len(group) * (block - 1), vocab]. Sequences near max_new_tokens get fewer drafts; none with 0."""
    remaining = [min(block - 1, s.params.max_new_tokens - s.num_generated) for s in group]
    plan = DraftPlan(
        block_size=block,
        last_tokens=[s.last_token for s in group],
        context_lens=[s.num_cached for s in group],
        page_tables=[list(s.page_table.pages) for s in group],
    )
    logits = execute(plan).view(len(group), block - 1, -1)
    proposals: Proposals = {}
    sampled = []
    for i, seq in enumerate(group):
        count = max(0, remaining[i])
        if count == 0:
            continue
        if seq.params.greedy:
            proposals[seq.request_id] = (logits[i, :count].argmax(dim=-1).tolist(), None)
        else:
            sampled.append((i, seq, count))
    if sampled:
        batch = SamplingBatch.from_params([seq.params for _, seq, _ in sampled], [seq.generator for _, seq, _ in sampled])
        repeated = batch.repeat_rows([count for _, _, count in sampled])
        q = repeated.probs(torch.cat([logits[i, :count] for i, _, count in sampled]))
        tokens = sample(q, repeated.generators).tolist()
        start = 0
        for _, seq, count in sampled:
            proposals[seq.request_id] = (tokens[start : start + count], q[start : start + count])
            start += count
    return proposals


def verify(seqs: list[Sequence], proposals: Proposals, logits: torch.Tensor, offsets: list[int]) -> dict[int, VerifyResult]:
    """logits: the target's rows for every sequence's [last token + drafts] (sequence i owns rows
    offsets[i]:offsets[i + 1]). Returns, for each index of a sequence with drafts, what to append."""
    spec = [i for i, seq in enumerate(seqs) if seq.request_id in proposals]
    greedy = [i for i in spec if seqs[i].params.greedy]
    sampled = [i for i in spec if not seqs[i].params.greedy]
    results: dict[int, VerifyResult] = {}
    if greedy:
        found = verify_greedy(
            [torch.tensor(proposals[seqs[i].request_id][0]) for i in greedy],
            [logits[offsets[i] : offsets[i + 1]] for i in greedy],
        )
        results.update(zip(greedy, found))
    if sampled:
        counts = [offsets[i + 1] - offsets[i] for i in sampled]
        rows = torch.cat([torch.arange(offsets[i], offsets[i + 1]) for i in sampled])
        target = SamplingBatch.from_params([seqs[i].params for i in sampled]).repeat_rows(counts).probs(
            logits.index_select(0, rows)
        )
        found = verify_sampled(
            [torch.tensor(proposals[seqs[i].request_id][0]) for i in sampled],
            [proposals[seqs[i].request_id][1] for i in sampled],
            list(torch.split(target, counts)),
            [seqs[i].generator for i in sampled],
        )
        results.update(zip(sampled, found))
    return results
