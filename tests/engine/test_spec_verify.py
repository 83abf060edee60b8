"""Speculative verification: greedy prefix + bonus rule, exactness of rejection sampling
(emitted tokens distributed as autoregressive target sampling, checked by chi-square, with broken
verifiers as negative controls), per-request reproducibility, and acceptance statistics."""
from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from engine.sampling.ops import sample
from engine.spec.spec_verify import AcceptanceStats, VerifyResult, verify_greedy, verify_sampled
from tests.engine.chi_square import chi_square_pvalue

VOCAB = 8
START_TOKEN = 2
TRIALS = 30000


# ---- a tiny synthetic model: p(next | prev) and draft tables q(next | prev) -----------------

def target_table() -> torch.Tensor:
    """[V, V] fixed random p(next | prev); token prev+1 is impossible after prev."""
    logits = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(11)) * 1.2
    table = torch.softmax(logits, dim=-1)
    table[torch.arange(VOCAB), (torch.arange(VOCAB) + 1) % VOCAB] = 0.0
    return table / table.sum(dim=1, keepdim=True)


def draft_table(kind: str, target: torch.Tensor) -> torch.Tensor:
    """poor: mass pushed to where p is small or zero, and q = 0 on the two most likely target
    tokens (reachable only through the residual); one_hot: a deterministic draft; exact: q = p."""
    if kind == "exact":
        return target.clone()
    if kind == "one_hot":
        return torch.nn.functional.one_hot(target.argmin(dim=1), VOCAB).float()
    table = 1.0 / (target + 0.05)
    table.scatter_(1, target.topk(2, dim=1).indices, 0.0)
    return table / table.sum(dim=1, keepdim=True)


Verifier = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Generator], tuple[torch.Tensor, torch.Tensor]]


def real_verifier(drafts, num_drafts, q, p, gen):
    results = verify_sampled(drafts, q, p, gen, num_drafts=num_drafts.tolist()).per_sequence()
    return (torch.tensor([r.num_accepted_drafts for r in results]), torch.tensor([r.tokens[-1] for r in results]))


def broken_resample_from_p(drafts, num_drafts, q, p, gen):
    """Accepts correctly but resamples rejections from p instead of norm(max(0, p - q))."""
    uniform = torch.rand(drafts.shape, generator=gen)
    accept = (uniform * q.gather(2, drafts[..., None])[..., 0] < p[:, :-1].gather(2, drafts[..., None])[..., 0])
    valid = torch.arange(drafts.shape[1])[None] < num_drafts[:, None]
    accepted = (accept & valid).long().cumprod(dim=1).sum(dim=1)
    return accepted, sample(p[torch.arange(len(drafts)), accepted], gen)


def broken_accept_always(drafts, num_drafts, q, p, gen):
    """Accepts every draft and samples the bonus from p."""
    return num_drafts.clone(), sample(p[torch.arange(len(drafts)), num_drafts], gen)


def speculative_step(prev: torch.Tensor, num_drafts: torch.Tensor, p_table: torch.Tensor, q_table: torch.Tensor,
                     verifier: Verifier, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One draft + verify step for a batch of independent trials, each after token prev[t] with
    num_drafts[t] drafts drawn autoregressively from q_table. -> (drafts [T, K], accepted [T], final [T])."""
    width = int(num_drafts.max())
    context = [prev]
    for _ in range(width):
        context.append(sample(q_table[context[-1]], gen))
    drafts = torch.stack(context[1:], dim=1)
    q = q_table[torch.stack(context[:-1], dim=1)]
    p = p_table[torch.stack(context, dim=1)]
    accepted, final = verifier(drafts, num_drafts, q, p, gen)
    return drafts, accepted, final


def first_two_tokens(verifier: Verifier, q_kind: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """TRIALS independent generations from START_TOKEN with 0..4 drafts per step (mixed in one
    batch); -> the first and second emitted tokens, continuing with a second step when the first
    emitted only one token."""
    gen = torch.Generator().manual_seed(seed)
    p_table = target_table()
    q_table = draft_table(q_kind, p_table)
    prev = torch.full((TRIALS,), START_TOKEN)
    num_drafts = torch.randint(0, 5, (TRIALS,), generator=gen)
    drafts, accepted, final = speculative_step(prev, num_drafts, p_table, q_table, verifier, gen)
    first = torch.where(accepted >= 1, drafts[:, 0], final)
    second = torch.where(accepted >= 2, drafts[:, 1], final)
    again = accepted == 0
    more = torch.randint(0, 5, (int(again.sum()),), generator=gen)
    drafts2, accepted2, final2 = speculative_step(first[again], more, p_table, q_table, verifier, gen)
    second[again] = torch.where(accepted2 >= 1, drafts2[:, 0], final2)
    return first, second


@pytest.mark.slow
@pytest.mark.parametrize("q_kind", ["poor", "one_hot", "exact"])
def test_sampled_verification_is_exact(q_kind: str) -> None:
    """The first emitted token ~ p(. | start) and the first two ~ p(a | start) p(b | a), whatever the draft."""
    p_table = target_table()
    first, second = first_two_tokens(real_verifier, q_kind, seed=5)
    assert chi_square_pvalue(torch.bincount(first, minlength=VOCAB), p_table[START_TOKEN]) > 1e-3
    joint_expected = (p_table[START_TOKEN][:, None] * p_table).flatten()
    assert chi_square_pvalue(torch.bincount(first * VOCAB + second, minlength=VOCAB**2), joint_expected) > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("broken", [broken_resample_from_p, broken_accept_always])
def test_broken_verifiers_are_rejected(broken: Verifier) -> None:
    """Negative control: the same statistics reject a verifier that is not exact."""
    p_table = target_table()
    first, second = first_two_tokens(broken, "poor", seed=5)
    first_p = chi_square_pvalue(torch.bincount(first, minlength=VOCAB), p_table[START_TOKEN])
    joint_expected = (p_table[START_TOKEN][:, None] * p_table).flatten()
    joint_p = chi_square_pvalue(torch.bincount(first * VOCAB + second, minlength=VOCAB**2), joint_expected)
    assert first_p < 1e-6 and joint_p < 1e-6


# ---- greedy verification ----------------------------------------------------------------

def reference_greedy(drafts: list[int], target_argmax: list[int]) -> list[int]:
    out = []
    for draft, wanted in zip(drafts, target_argmax):
        if draft != wanted:
            break
        out.append(draft)
    return out + [target_argmax[len(out)]]


def test_verify_greedy_mixed_lengths() -> None:
    """Longest matching prefix + target argmax bonus, for all-accepted, none-accepted, partial and
    zero-draft sequences in one batch; list, padded and packed layouts agree."""
    gen = torch.Generator().manual_seed(3)
    lengths = [3, 3, 5, 0, 4, 1, 2]
    mismatch_at = [None, 0, 2, None, 3, 0, None]
    drafts, logits, expected = [], [], []
    for length, bad in zip(lengths, mismatch_at):
        wanted = torch.randint(0, 50, (length + 1,), generator=gen)
        row_logits = torch.randn(length + 1, 50, generator=gen)
        row_logits[torch.arange(length + 1), wanted] = 10.0
        draft = wanted[:length].clone()
        if bad is not None:
            draft[bad] = (draft[bad] + 1) % 50
        drafts.append(draft)
        logits.append(row_logits)
        expected.append(reference_greedy(draft.tolist(), wanted.tolist()))
    results = verify_greedy(drafts, logits).per_sequence()
    assert [r.tokens for r in results] == expected
    assert [r.num_accepted_drafts for r in results] == [3, 0, 2, 0, 3, 0, 2]
    assert verify_greedy(torch.cat(drafts), torch.cat(logits), num_drafts=lengths).per_sequence() == results
    padded_drafts = torch.zeros(len(lengths), 5, dtype=torch.long)
    padded_logits = torch.zeros(len(lengths), 6, 50)
    for index, (draft, row_logits) in enumerate(zip(drafts, logits)):
        padded_drafts[index, : len(draft)] = draft
        padded_logits[index, : len(row_logits)] = row_logits
    assert verify_greedy(padded_drafts, padded_logits, num_drafts=lengths).per_sequence() == results


def test_verify_greedy_bonus_ties_take_lowest_index() -> None:
    """The bonus token is the lowest index among tied maxima."""
    logits = torch.zeros(2, 6)
    logits[0, 4] = 1.0
    logits[1, [1, 3]] = 2.0
    assert verify_greedy([torch.tensor([4])], [logits]).per_sequence() == [VerifyResult([4, 1], 1)]


# ---- sampled verification: edge cases and reproducibility -------------------------------

def test_sampled_accepts_everything_when_draft_equals_target() -> None:
    """q == p: every draft is accepted (u * q < p for u in [0, 1))."""
    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(64, 4, VOCAB, generator=gen), dim=-1)
    drafts = sample(probs[:, :3].reshape(-1, VOCAB), gen).reshape(64, 3)
    results = verify_sampled(drafts, probs[:, :3], probs, gen).per_sequence()
    assert all(r.num_accepted_drafts == 3 for r in results)


def test_sampled_never_accepts_impossible_draft() -> None:
    """A draft with target probability 0 is always rejected and never emitted."""
    gen = torch.Generator().manual_seed(0)
    target = torch.softmax(torch.randn(500, 2, VOCAB, generator=gen), dim=-1)
    target[:, 0, 5] = 0.0
    target = target / target.sum(dim=-1, keepdim=True)
    draft_probs = torch.full((500, 1, VOCAB), 1.0 / VOCAB)
    results = verify_sampled(torch.full((500, 1), 5), draft_probs, target, gen).per_sequence()
    assert all(r.num_accepted_drafts == 0 and r.tokens[0] != 5 for r in results)


def test_seeded_verification_is_reproducible_in_any_batch() -> None:
    """A sequence verified with its own seeded generator gets the same tokens alone or at another
    row of a batch with different draft counts; list and packed layouts agree."""
    gen = torch.Generator().manual_seed(9)
    lengths = [2, 4, 0, 3]
    drafts = [torch.randint(0, VOCAB, (n,), generator=gen) for n in lengths]
    q = [torch.softmax(torch.randn(n, VOCAB, generator=gen), dim=-1) for n in lengths]
    p = [torch.softmax(torch.randn(n + 1, VOCAB, generator=gen), dim=-1) for n in lengths]

    def seeded() -> list[torch.Generator]:
        return [torch.Generator().manual_seed(100 + i) for i in range(len(lengths))]

    batch = verify_sampled(drafts, q, p, seeded()).per_sequence()
    assert verify_sampled(torch.cat(drafts), torch.cat(q), torch.cat(p), seeded(), num_drafts=lengths).per_sequence() == batch
    for index in range(len(lengths)):
        alone = verify_sampled([drafts[index]], [q[index]], [p[index]], [seeded()[index]]).per_sequence()
        assert alone == [batch[index]]
    draws = {tuple(verify_sampled([drafts[1]], [q[1]], [p[1]], [torch.Generator().manual_seed(s)]).per_sequence()[0].tokens)
             for s in range(40)}
    assert len(draws) > 1, "different seeds should give different outcomes"


def test_one_hot_rows_reduce_sampled_to_greedy() -> None:
    """Greedy requests in a sampled batch (one-hot p and q) get exactly verify_greedy's tokens."""
    gen = torch.Generator().manual_seed(4)
    lengths = [3, 0, 2, 4]
    logits = [torch.randn(n + 1, VOCAB, generator=gen) for n in lengths]
    drafts = [torch.where(torch.rand(n, generator=gen) < 0.7, lg[:n].argmax(dim=-1), torch.randint(0, VOCAB, (n,), generator=gen))
              for n, lg in zip(lengths, logits)]
    one_hot_p = [torch.nn.functional.one_hot(lg.argmax(dim=-1), VOCAB).float() for lg in logits]
    one_hot_q = [torch.nn.functional.one_hot(d, VOCAB).float() for d in drafts]
    assert verify_sampled(drafts, one_hot_q, one_hot_p, gen).per_sequence() == verify_greedy(drafts, logits).per_sequence()


def test_sampled_with_no_drafts_emits_one_target_token() -> None:
    """A batch where no sequence has drafts emits exactly one token per sequence, from p's support."""
    p = torch.zeros(200, 1, VOCAB)
    p[:, 0, 3], p[:, 0, 6] = 0.25, 0.75
    results = verify_sampled(torch.zeros(200, 0, dtype=torch.long), torch.zeros(200, 0, VOCAB), p, None).per_sequence()
    tokens = [r.tokens for r in results]
    assert all(r.num_accepted_drafts == 0 for r in results) and {tuple(t) for t in tokens} == {(3,), (6,)}


# ---- acceptance statistics --------------------------------------------------------------

def test_acceptance_stats_counts_and_merge() -> None:
    """Mean tokens per step counts the bonus; per-position rate = accepted / reached; merge == one stats."""
    steps = [(VerifyResult([1, 2, 3], 2), 3), (VerifyResult([7], 0), 2), (VerifyResult([4, 5, 6, 8], 3), 3),
             (VerifyResult([9], 0), 0)]
    stats = AcceptanceStats()
    stats.record_all([r for r, _ in steps], [n for _, n in steps])
    assert stats.mean_accepted_tokens == pytest.approx((2 + 0 + 3 + 0 + 4) / 4)
    assert stats.acceptance_rate == pytest.approx(5 / 8)
    assert stats.position_attempted == [3, 2, 2] and stats.position_accepted == [2, 2, 1]
    assert stats.per_position_acceptance == pytest.approx([2 / 3, 1.0, 0.5])
    first, second = AcceptanceStats(), AcceptanceStats()
    first.record_all([r for r, _ in steps[:2]], [n for _, n in steps[:2]])
    second.record_all([r for r, _ in steps[2:]], [n for _, n in steps[2:]])
    assert first.merge(second) == stats and second.merge(first) == stats
    assert stats.to_dict()["per_position_acceptance"] == stats.per_position_acceptance
    with pytest.raises(ValueError):
        stats.record(VerifyResult([1, 2, 3], 2), 1)
    assert AcceptanceStats().mean_accepted_tokens == 0.0
