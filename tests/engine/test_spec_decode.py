"""Speculative decoding in the engine is exact: greedy outputs are unchanged and sampled outputs
follow the target distribution, whatever the (here deliberately poor, random) draft proposes."""
from __future__ import annotations

import math

import pytest
import torch

from engine import LLM, SamplingParams
from engine.spec import spec_decode
from tests.engine.spec_fixtures import add_random_draft, make_small_vocab_checkpoint, make_tiny_checkpoint
from tests.engine.chi_square import chi_square_pvalue

PROMPTS = [[5 + i % 7, 6 + i, 7, 8 + (3 * i) % 11] * (1 + i % 5) for i in range(20)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("spec") / "m", "heads24")
    add_random_draft(path, block_size=16)
    return str(path)


@pytest.fixture(scope="module")
def reference(model_dir):
    params = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    with LLM(model_dir, attention_backend="torch", draft_model="") as llm:
        return llm.generate(PROMPTS, params)


@pytest.mark.slow  # four engines x 40 generations of 16 tokens: ~10 s of CPU
@pytest.mark.parametrize("block_size", [2, 4, 8, 16])
def test_greedy_spec_decoding_is_token_identical(model_dir, reference, block_size):
    """For 20 prompts, alone (batch 1) and 8 at a time, spec decoding with block size B emits exactly
    the tokens of plain greedy decoding, and the engine records its acceptance statistics."""
    params = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True, block_size=block_size)
    with LLM(model_dir, attention_backend="torch", spec_block_size=16) as llm:
        solo = [llm.generate([prompt], params)[0] for prompt in PROMPTS]
        batched = []
        for start in range(0, len(PROMPTS), 8):
            batched.extend(llm.generate(PROMPTS[start : start + 8], params))
        stats = llm.acceptance_stats
    assert solo == reference
    assert batched == reference
    decoded = 2 * len(PROMPTS) * (16 - 1)  # solo + batched runs; each request's first token comes from prefill
    assert stats.num_verify_steps <= decoded < stats.num_verify_steps + stats.num_accepted_drafts + 1  # every step emits 1 + accepted
    assert stats.num_accepted_drafts <= stats.num_drafts <= stats.num_verify_steps * block_size


def test_spec_off_per_request_and_block_size_bound(model_dir, reference):
    """speculative=False runs without verify steps; a block size above the server maximum is refused."""
    with LLM(model_dir, attention_backend="torch", spec_block_size=4) as llm:
        params = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True, speculative=False)
        assert llm.generate(PROMPTS[:3], params) == reference[:3]
        assert llm.acceptance_stats.num_verify_steps == 0
        with pytest.raises(ValueError, match="block_size"):
            llm.generate([PROMPTS[0]], SamplingParams(max_new_tokens=4, block_size=8))


VOCAB = 16
SAMPLES = 20_000
CONTROL_SAMPLES = SAMPLES // 4  # the negative control: power shown with fewer samples holds with more
PROMPT = [3, 7, 2, 9]


def _exact_second_token_distribution(llm: LLM, temperature: float) -> torch.Tensor:
    """P(token 2) = sum over t1 of P(t1 | prompt) P(t2 | prompt, t1), from the target's logits."""
    first = torch.softmax(llm.logits(PROMPT)[-1] / temperature, dim=-1)
    second = torch.zeros(VOCAB)
    for token in range(VOCAB):
        second += first[token] * torch.softmax(llm.logits(PROMPT + [token])[-1] / temperature, dim=-1)
    return second


def _second_tokens(llm: LLM, temperature: float, samples: int = SAMPLES) -> torch.Tensor:
    params = SamplingParams(max_new_tokens=2, temperature=temperature, ignore_eos=True, block_size=4)
    torch.manual_seed(1234)
    outputs = llm.generate([PROMPT] * samples, params)
    return torch.bincount(torch.tensor([out[1] for out in outputs]), minlength=VOCAB).float()


@pytest.fixture(scope="module")
def small_vocab_llm(tmp_path_factory):
    path = make_small_vocab_checkpoint(tmp_path_factory.mktemp("vocab") / "m", vocab_size=VOCAB)
    add_random_draft(path, block_size=4, seed=3)
    with LLM(str(path), attention_backend="torch", spec_block_size=4, max_running=1024,
             max_batched_tokens=4096) as llm:
        yield llm


@pytest.mark.slow
def test_sampled_spec_decoding_matches_target_distribution(small_vocab_llm):
    """20k sampled second tokens (the first token a verify step emits) follow the exact target
    marginal (chi-square p > 1e-3), with a random draft that is rarely right."""
    llm = small_vocab_llm
    exact = _exact_second_token_distribution(llm, temperature=1.0)
    counts = _second_tokens(llm, temperature=1.0)
    p_value = chi_square_pvalue(counts, exact, min_expected=5)
    print(f"spec sampling chi-square p-value {p_value:.4f}; acceptance {llm.acceptance_stats.acceptance_rate:.3f}")
    assert llm.acceptance_stats.num_verify_steps >= SAMPLES
    assert 0.0 < llm.acceptance_stats.acceptance_rate < 0.9
    assert p_value > 1e-3


@pytest.mark.slow
def test_broken_verifier_is_detected(small_vocab_llm, monkeypatch):
    """Negative control: a verifier that always accepts the draft (ignoring p/q) fails the same statistic, at a
    quarter of the samples the real verifier is tested with (so the real test's sample size has that power)."""

    def accept_everything(draft_tokens, draft_probs, target_probs, generators):
        accepted = torch.tensor([len(tokens) for tokens in draft_tokens])
        finals = torch.stack([p[-1].argmax() for p in target_probs])
        return None, accepted, finals

    monkeypatch.setattr(spec_decode, "verify_sampled", accept_everything)
    llm = small_vocab_llm
    exact = _exact_second_token_distribution(llm, temperature=1.0)
    p_value = chi_square_pvalue(_second_tokens(llm, temperature=1.0, samples=CONTROL_SAMPLES), exact, min_expected=5)
    print(f"broken verifier chi-square p-value {p_value:.3g}")
    assert p_value < 1e-6
    assert not math.isnan(p_value)


PENALISED = dict(presence_penalty=1.0, frequency_penalty=1.5, repetition_penalty=2.0, logit_bias={2: -100.0, 5: 1.5})


def _exact_third_token_distribution(llm: LLM, params: SamplingParams) -> torch.Tensor:
    """P(t3) = sum over t1, t2 of P(t1) P(t2 | t1) P(t3 | t1, t2), each factor the softmax of the target's logits
    adjusted by the reference formulas for the tokens generated before it."""
    from tests.engine.test_penalties import reference_adjust

    eos = tuple(llm.model_config.eos_token_id)

    def dist(generated: list[int]) -> torch.Tensor:
        row = reference_adjust(llm.logits(PROMPT + generated)[-1].tolist(), params, PROMPT, generated, eos)
        return torch.softmax(torch.tensor(row, dtype=torch.float64) / params.temperature, dim=-1)

    first, third = dist([]), torch.zeros(VOCAB, dtype=torch.float64)
    for t1 in range(VOCAB):
        if first[t1] == 0:
            continue
        second = dist([t1])
        for t2 in range(VOCAB):
            if second[t2] > 0:
                third += first[t1] * second[t2] * dist([t1, t2])
    return third


@pytest.mark.slow
def test_sampled_spec_decoding_with_penalties_matches_the_penalised_distribution(small_vocab_llm):
    """20k sampled third tokens (after two generated tokens, the second often an accepted draft of the same verify
    block) with presence / frequency / repetition penalties and a logit_bias ban follow the exact penalised
    marginal (chi-square p > 1e-3), and the banned token never appears."""
    llm = small_vocab_llm
    params = SamplingParams(max_new_tokens=3, temperature=1.0, ignore_eos=True, block_size=4, **PENALISED)
    exact = _exact_third_token_distribution(llm, params)
    before = llm.acceptance_stats.num_accepted_drafts
    torch.manual_seed(4321)
    outputs = llm.generate([PROMPT] * SAMPLES, params)
    counts = torch.bincount(torch.tensor([out[2] for out in outputs]), minlength=VOCAB).float()
    p_value = chi_square_pvalue(counts, exact, min_expected=5)
    print(f"penalised spec sampling chi-square p-value {p_value:.4f}")
    assert llm.acceptance_stats.num_accepted_drafts - before > 500  # drafts of the same block were accepted
    assert not any(2 in out for out in outputs)
    assert p_value > 1e-3


def test_greedy_verdict_is_the_longest_matching_prefix_then_the_target_token():
    """Host-side greedy verification: drafts are kept up to the first disagreement with the target's argmax,
    then the argmax at that row is emitted (all kept: the bonus row's argmax)."""
    from engine.spec.spec_decode import greedy_verdict

    assert greedy_verdict([5, 6, 7], [5, 6, 9, 1]) == ([5, 6, 9], 2)
    assert greedy_verdict([5, 6, 7], [4, 6, 7, 1]) == ([4], 0)
    assert greedy_verdict([5, 6, 7], [5, 6, 7, 1]) == ([5, 6, 7, 1], 3)
    assert greedy_verdict([], [8]) == ([8], 0)
