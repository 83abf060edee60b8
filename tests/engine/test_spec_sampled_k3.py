"""Sampled speculative decoding on a hybrid K3 model with a DSpark draft is lossless: the tokens a verify step
emits follow the target's exact distribution (drafts formed left to right with the Markov bias, rejection
sampling against the Markov-corrected draft probabilities, KDA state committed only up to the kept position),
and the same statistic rejects a verifier that accepts every draft (negative control)."""
from __future__ import annotations

import math

import pytest
import torch

from engine import LLM, SamplingParams
from engine.spec import spec_decode
from tests.engine.chi_square import chi_square_pvalue
from tests.engine.dspark_fixtures import make_small_vocab_k3_with_dspark

VOCAB = 16
SAMPLES = 20_000
CONTROL_SAMPLES = SAMPLES // 4  # the negative control: power shown with fewer samples holds with more
PROMPT = [3, 7, 2, 9]
TEMPERATURE = 0.9
BLOCK = 3  # verify [t1, d1, d2]: t2 and t3 both come from the first verify step when d1 is accepted


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    model_dir = make_small_vocab_k3_with_dspark(tmp_path_factory.mktemp("k3_sampled"), VOCAB, gamma=BLOCK - 1)
    # A few hundred sequences per engine step: 20k requests take ~40 rounds of prefill and verify steps. One
    # torch thread: the ops are tiny, and on a shared 2-core machine intra-op threads mostly wait for each other.
    with LLM(str(model_dir), attention_backend="torch", spec_block_size=BLOCK, max_running=512,
             max_batched_tokens=4 * 512, kv_memory_bytes=1 << 29, num_threads=1) as engine:
        yield engine


@pytest.fixture(scope="module")
def exact_joint(llm) -> torch.Tensor:
    """P(t2, t3) = sum_t1 P(t1 | p) P(t2 | p, t1) P(t3 | p, t1, t2) from the target's own logits: [VOCAB, VOCAB]."""
    n = len(PROMPT)
    joint = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    first = torch.softmax(llm.logits(PROMPT)[-1].double() / TEMPERATURE, dim=-1)
    for t1 in range(VOCAB):
        # P(t2 | p, t1) once per t1: forwards over p + [t1, t2] do not round row n identically for every t2
        # (logits differ by up to ~4e-6 between them), so 16 rows taken from 16 forwards need not sum to 1
        # within 1e-9.
        second = torch.softmax(llm.logits(PROMPT + [t1])[n].double() / TEMPERATURE, dim=-1)
        for t2 in range(VOCAB):
            third = torch.softmax(llm.logits(PROMPT + [t1, t2])[n + 1].double() / TEMPERATURE, dim=-1)
            joint[t2] += first[t1] * second[t2] * third
    assert abs(float(joint.sum()) - 1.0) < 1e-9
    return joint


def _joint_counts(llm: LLM, samples: int = SAMPLES) -> torch.Tensor:
    """Counts of (second, third) generated token over `samples` sampled speculative runs: [VOCAB, VOCAB]."""
    params = SamplingParams(max_new_tokens=3, temperature=TEMPERATURE, ignore_eos=True, block_size=BLOCK)
    torch.manual_seed(1234)
    outputs = llm.generate([PROMPT] * samples, params)
    assert all(len(out) == 3 for out in outputs)
    pairs = torch.tensor([out[1] * VOCAB + out[2] for out in outputs])
    return torch.bincount(pairs, minlength=VOCAB * VOCAB).view(VOCAB, VOCAB).double()


@pytest.mark.slow
def test_sampled_spec_on_k3_matches_exact_target_marginal(llm, exact_joint):
    """20k (t2, t3) pairs from sampled speculation (DSpark Markov drafts, rejection sampling, KDA snapshot commit)
    follow the exact target joint: chi-square p > 1e-3; the draft is accepted sometimes but far from always."""
    stats_before = (llm.acceptance_stats.num_verify_steps, llm.acceptance_stats.num_accepted_drafts,
                    llm.acceptance_stats.num_drafts)
    counts = _joint_counts(llm)
    steps, accepted, drafts = (now - before for now, before in zip(
        (llm.acceptance_stats.num_verify_steps, llm.acceptance_stats.num_accepted_drafts, llm.acceptance_stats.num_drafts),
        stats_before))
    p_value = chi_square_pvalue(counts, exact_joint, min_expected=5)
    print(f"K3 sampled spec chi-square p-value {p_value:.4f}; accepted {accepted}/{drafts} drafts in {steps} steps")
    assert steps >= SAMPLES  # every request verified at least once
    assert 0.02 < accepted / drafts < 0.9  # both the accept and the resample paths carry weight
    assert p_value > 1e-3


@pytest.mark.slow
def test_always_accept_verifier_is_rejected_on_k3(llm, exact_joint, monkeypatch):
    """Negative control: a verifier that keeps every draft (ignoring p/q) fails the same chi-square test, at a
    quarter of the samples the real verifier is tested with (so the real test's sample size has that power)."""

    def accept_everything(draft_tokens, draft_probs, target_probs, generators):
        accepted = torch.tensor([len(tokens) for tokens in draft_tokens])
        finals = torch.stack([p[-1].argmax() for p in target_probs])
        return None, accepted, finals

    monkeypatch.setattr(spec_decode, "verify_sampled", accept_everything)
    p_value = chi_square_pvalue(_joint_counts(llm, CONTROL_SAMPLES), exact_joint, min_expected=5)
    print(f"always-accept verifier chi-square p-value {p_value:.3g}")
    assert not math.isnan(p_value)
    assert p_value < 1e-6
