"""Sampling ops: renormalisation filters against per-row Python references, seeded and
distribution-exact sampling, greedy tie rule, logprobs and the SamplingBatch step API."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.sampling.ops import (
    SamplingBatch,
    logits_to_probs,
    make_generator,
    min_p_renorm_prob,
    resolve_kernels,
    sample,
    token_logprobs,
    top_k_renorm_prob,
    top_logprobs,
    top_p_renorm_prob,
)
from engine.sampling_params import SamplingParams
from tests.engine.chi_square import chi_square_pvalue


# ---- per-row Python references ------------------------------------------------------------

def ref_top_k_keep(row: list[float], k: int) -> list[bool]:
    if k <= 0 or k >= len(row):
        return [True] * len(row)
    kth = sorted(row, reverse=True)[k - 1]
    return [value >= kth for value in row]


def ref_top_p_keep(row: list[float], p: float) -> list[bool]:
    if p >= 1.0:
        return [True] * len(row)
    ranked = sorted(row, reverse=True)
    target = p * sum(ranked)
    cumulative, boundary = 0.0, ranked[-1]
    for value in ranked:
        cumulative += value
        if cumulative >= target:
            boundary = value
            break
    return [value >= boundary for value in row]


def ref_min_p_keep(row: list[float], min_p: float) -> list[bool]:
    threshold = np.float32(min_p) * np.float32(max(row))  # the op's float32 threshold
    return [np.float32(value) >= threshold for value in row]


@st.composite
def prob_rows(draw: st.DrawFn) -> torch.Tensor:
    """[N, V] float32 rows summing to 1; small integer weights make many exact ties."""
    num_rows = draw(st.integers(1, 5))
    vocab = draw(st.integers(1, 24))
    rows = []
    for _ in range(num_rows):
        if draw(st.booleans()):
            weights = draw(st.lists(st.integers(0, 4), min_size=vocab, max_size=vocab))
        else:
            weights = draw(st.lists(st.floats(0.0, 1.0, width=32), min_size=vocab, max_size=vocab))
        if sum(weights) <= 0:
            weights[draw(st.integers(0, vocab - 1))] = 1
        rows.append(weights)
    weights = torch.tensor(rows, dtype=torch.float32)
    return weights / weights.sum(dim=1, keepdim=True)


def check_against_reference(probs: torch.Tensor, out: torch.Tensor, keep: list[list[bool]]) -> None:
    keep_mask = torch.tensor(keep, dtype=torch.bool)
    expected_zero = ~keep_mask | (probs == 0)
    assert torch.equal(out == 0, expected_zero), "zeros differ from the reference's dropped set"
    assert torch.allclose(out.sum(dim=1), torch.ones(out.shape[0]), atol=1e-5)
    kept = probs * keep_mask
    assert torch.allclose(out, kept / kept.sum(dim=1, keepdim=True), atol=1e-6)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(data=st.data(), probs=prob_rows())
def test_top_k_matches_reference(data: st.DataObject, probs: torch.Tensor) -> None:
    """top_k keeps every entry >= the k-th largest (ties kept), per-row k incl. k <= 0 and k >= V."""
    vocab = probs.shape[1]
    ks = [data.draw(st.integers(-2, vocab + 2)) for _ in range(probs.shape[0])]
    out = top_k_renorm_prob(probs, torch.tensor(ks))
    check_against_reference(probs, out, [ref_top_k_keep(r, k) for r, k in zip(probs.tolist(), ks)])
    bound = max([k for k in ks if 0 < k < vocab], default=0)
    if bound:
        assert torch.equal(top_k_renorm_prob(probs, torch.tensor(ks), max_k=bound), out)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(data=st.data(), probs=prob_rows())
def test_top_p_matches_reference(data: st.DataObject, probs: torch.Tensor) -> None:
    """top_p keeps the smallest head reaching mass p plus all ties of the boundary value; p=1 no-op."""
    p_strategy = st.one_of(st.just(1.0), st.sampled_from([0.25, 0.5, 0.75]), st.floats(0.0, 1.0, width=32, exclude_min=True))
    ps = torch.tensor([data.draw(p_strategy) for _ in range(probs.shape[0])], dtype=torch.float32)
    out = top_p_renorm_prob(probs, ps)
    check_against_reference(probs, out, [ref_top_p_keep(r, p) for r, p in zip(probs.tolist(), ps.tolist())])


@settings(max_examples=150, deadline=None, derandomize=True)
@given(data=st.data(), probs=prob_rows())
def test_min_p_matches_reference(data: st.DataObject, probs: torch.Tensor) -> None:
    """min_p drops entries below min_p * row max and renormalises; per-row min_p."""
    mins = torch.tensor([data.draw(st.floats(0.0, 1.0, width=32)) for _ in range(probs.shape[0])])
    out = min_p_renorm_prob(probs, mins)
    check_against_reference(probs, out, [ref_min_p_keep(r, m) for r, m in zip(probs.tolist(), mins.tolist())])


def test_filters_on_a_tied_row() -> None:
    """A row of equal values survives top-k=1 and top-p=0.1 whole (every entry ties the boundary)."""
    probs = torch.tensor([[0.25, 0.25, 0.25, 0.25], [0.4, 0.2, 0.2, 0.2]])
    assert torch.equal(top_k_renorm_prob(probs, torch.tensor([1, 2])), torch.tensor([[0.25] * 4, [0.4, 0.2, 0.2, 0.2]]))
    assert torch.allclose(top_p_renorm_prob(probs, torch.tensor([0.1, 0.5])), torch.tensor([[0.25] * 4, [0.4, 0.2, 0.2, 0.2]]))
    assert torch.equal(top_p_renorm_prob(probs, torch.tensor([0.1, 0.3])), torch.tensor([[0.25] * 4, [1.0, 0, 0, 0]]))


def test_top_p_mass_reaching_p_exactly_stops_there() -> None:
    """When the head's mass equals p exactly, the cut is right after it (mass 'reaches' p)."""
    probs = torch.tensor([[0.5, 0.25, 0.125, 0.125], [0.5, 0.25, 0.125, 0.125]])
    out = top_p_renorm_prob(probs, torch.tensor([0.5, 0.875]))
    assert torch.equal(out, torch.tensor([[1.0, 0, 0, 0], [0.5, 0.25, 0.125, 0.125]]))


def test_logits_to_probs_composes_filters_and_greedy_one_hot() -> None:
    """Sampled rows = min_p(top_p(top_k(softmax(logits / t)))); greedy rows = one-hot of the lowest argmax."""
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    logits[2, 7] = logits[2, 30] = logits[2].max() + 1.0
    temperature = torch.tensor([0.7, 1.3, 0.0])
    top_k, top_p, min_p = torch.tensor([10, -1, 5]), torch.tensor([0.8, 0.6, 1.0]), torch.tensor([0.05, 0.0, 0.0])
    probs = logits_to_probs(logits, temperature, top_k, top_p, min_p)
    base = torch.softmax(logits[:2] / temperature[:2, None], dim=-1)
    expected = min_p_renorm_prob(top_p_renorm_prob(top_k_renorm_prob(base, top_k[:2]), top_p[:2]), min_p[:2])
    assert torch.allclose(probs[:2], expected, atol=1e-6)
    assert probs.dtype == torch.float32
    assert probs[2, 7] == 1.0 and probs[2].sum() == 1.0


@pytest.mark.slow
def test_sample_matches_distribution() -> None:
    """The exponential race draws exactly from probs (chi-square over 20k draws, zeros never drawn)."""
    probs = torch.tensor([0.4, 0.0, 0.05, 0.25, 0.0, 0.2, 0.07, 0.03])
    draws = sample(probs.expand(20000, -1), torch.Generator().manual_seed(7))
    assert chi_square_pvalue(torch.bincount(draws, minlength=8), probs) > 1e-3


@pytest.mark.slow
def test_sample_detects_wrong_distribution() -> None:
    """Control for the statistic: draws from probs fail a fit against a slightly different table."""
    probs = torch.tensor([0.4, 0.05, 0.05, 0.25, 0.05, 0.2])
    draws = sample(probs.expand(20000, -1), torch.Generator().manual_seed(7))
    shifted = torch.tensor([0.37, 0.05, 0.08, 0.25, 0.05, 0.2])
    assert chi_square_pvalue(torch.bincount(draws, minlength=6), shifted) < 1e-6


def _run_steps(batch: SamplingBatch, logits_per_step: list[torch.Tensor]) -> list[torch.Tensor]:
    return [batch.sample(logits) for logits in logits_per_step]


def test_seeded_request_is_reproducible_in_any_batch() -> None:
    """A seeded request's tokens are the same alone and at row 5 of a batch of 8 with other requests."""
    torch.manual_seed(1)
    steps = 12
    request = SamplingParams(temperature=0.9, top_k=20, top_p=0.95, seed=1234)
    own_logits = [torch.randn(1, 64) for _ in range(steps)]
    alone = SamplingBatch.from_params([request], [make_generator(request.seed)])
    tokens_alone = torch.cat(_run_steps(alone, own_logits))

    others = [SamplingParams(temperature=1.0, seed=s) for s in range(5)] + [SamplingParams(temperature=0.0)]
    others.append(SamplingParams(temperature=1.2, min_p=0.1))
    params = others[:5] + [request] + others[5:]
    gens = [make_generator(p.seed) for p in params]
    batch = SamplingBatch.from_params(params, gens)
    batched_logits = []
    for own in own_logits:
        step = torch.randn(8, 64)
        step[5] = own[0]
        batched_logits.append(step)
    tokens_batched = torch.stack(_run_steps(batch, batched_logits))[:, 5]
    assert torch.equal(tokens_alone, tokens_batched)
    other_seed = SamplingBatch.from_params([request], [make_generator(99)])
    assert not torch.equal(torch.cat(_run_steps(other_seed, own_logits)), tokens_alone)


def test_greedy_rows_take_lowest_argmax() -> None:
    """Greedy: argmax with ties resolved to the lowest index, via the all-greedy fast path and in a mixed batch."""
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0], [5.0, 5.0, 5.0, 5.0]])
    greedy = SamplingBatch.from_params([SamplingParams(temperature=0.0)] * 2)
    assert greedy.all_greedy and greedy.sample(logits).tolist() == [1, 0]
    mixed = SamplingBatch.from_params([SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=3)],
                                      [None, make_generator(3)])
    assert not mixed.all_greedy and mixed.any_greedy
    for _ in range(20):
        assert mixed.sample(logits)[0].item() == 1


def test_batch_flags_and_repeat_rows() -> None:
    """from_params sets flags only for filters a sampled row enables; repeat_rows repeats settings and generators."""
    gen = make_generator(5)
    batch = SamplingBatch.from_params(
        [SamplingParams(temperature=0.0, top_k=3, logprobs=2), SamplingParams(top_p=0.9, seed=5)], [None, gen])
    assert (batch.needs_top_k, batch.needs_top_p, batch.needs_min_p, batch.max_logprobs) == (False, True, False, 2)
    assert batch.top_k.tolist() == [-1, -1]
    repeated = batch.repeat_rows([2, 3])
    assert repeated.top_p.tolist() == pytest.approx([1.0, 1.0, 0.9, 0.9, 0.9])
    assert repeated.greedy.tolist() == [True, True, False, False, False]
    assert repeated.generators == (None, None, gen, gen, gen)
    with pytest.raises(ValueError):
        SamplingBatch.from_params([SamplingParams()], [None, None])


def test_batch_probs_equal_unskipped_filters() -> None:
    """Skipping filters no row enables (and the greedy merge when no row is greedy) does not change probs."""
    torch.manual_seed(4)
    logits = torch.randn(3, 30)
    params = [SamplingParams(temperature=0.5, top_k=4), SamplingParams(temperature=1.5), SamplingParams(top_k=7)]
    probs = SamplingBatch.from_params(params).probs(logits)
    full = logits_to_probs(logits, torch.tensor([0.5, 1.5, 1.0]), torch.tensor([4, -1, 7]),
                           torch.ones(3), torch.zeros(3))
    assert torch.allclose(probs, full, atol=1e-7)
    assert int((probs[0] > 0).sum()) == 4 and int((probs[2] > 0).sum()) == 7


def test_logprobs_are_raw_log_softmax() -> None:
    """top_logprobs / token_logprobs read log_softmax of the raw logits (no temperature)."""
    torch.manual_seed(2)
    logits = torch.randn(3, 40)
    values, ids = top_logprobs(logits, 5)
    reference = torch.log_softmax(logits, dim=-1)
    assert torch.allclose(values, reference.sort(dim=-1, descending=True).values[:, :5])
    assert torch.allclose(reference.gather(1, ids), values)
    chosen = torch.tensor([3, 0, 39])
    assert torch.allclose(token_logprobs(logits, chosen), reference[torch.arange(3), chosen])


def test_kernel_resolution() -> None:
    """CPU always resolves to the torch kernels; unknown names are rejected."""
    assert resolve_kernels("cpu").name == "torch"
    assert resolve_kernels("cpu", "flashinfer").name == "torch"
    with pytest.raises(ValueError):
        resolve_kernels("cuda", "nonexistent")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fast sampling kernels need a GPU")
def test_fast_kernels_match_torch() -> None:
    """The GPU kernels picked by "auto" agree with the torch reference, ties and per-row k/p included."""
    kernels = resolve_kernels("cuda")
    if kernels.name == "torch":
        pytest.skip("no fast sampling kernels importable")
    torch.manual_seed(3)
    probs = torch.softmax(torch.randn(16, 1000, device="cuda") * 3, dim=-1)
    probs[0] = 1.0 / 1000
    top_k = torch.tensor([5, 0, -1, 1000, 3, 50, 1, 999] * 2, device="cuda")
    top_p = torch.tensor([0.5, 1.0, 0.9, 0.1] * 4, device="cuda")
    assert torch.allclose(kernels.top_k_renorm(probs, top_k, None), top_k_renorm_prob(probs, top_k), atol=1e-5)
    assert torch.allclose(kernels.top_p_renorm(probs, top_p), top_p_renorm_prob(probs, top_p), atol=1e-5)
