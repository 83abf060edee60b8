"""Speculation back-off (engine/spec/spec_policy.py): the policy's arithmetic, and an engine that backs off
(fewer verify steps, plain steps in between) still emits exactly the plain greedy tokens."""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.spec.spec_policy import SpecBackoff, SpecState, record_verify, should_speculate
from tests.engine.dspark_fixtures import make_k3_with_dspark
from tests.engine.spec_fixtures import add_random_draft, make_tiny_checkpoint

PROMPTS = [[5 + i % 7, 6 + i, 7, 8 + (3 * i) % 11] * (1 + i % 4) for i in range(6)]


def greedy(speculative: bool = True) -> SamplingParams:
    return SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True, speculative=speculative)


def test_disabled_policy_always_speculates():
    """min_tokens_per_step <= 1 never backs off, whatever the verify steps emitted."""
    policy, state = SpecBackoff(1.0), SpecState()
    for _ in range(5):
        record_verify(policy, state, 1)
        assert should_speculate(policy, state)
    assert state == SpecState()


def test_backoff_doubles_while_probes_fail_and_resets_when_one_pays():
    """Below the threshold: skip first_backoff steps, probe; each failed probe doubles the skip (capped);
    a probe that pays brings speculation back every step."""
    policy = SpecBackoff(min_tokens_per_step=2.0, ema_weight=0.5, first_backoff=2, max_backoff=8)
    state = SpecState()
    record_verify(policy, state, 1)  # average 1 < 2: back off
    skips = []
    for _ in range(4):
        skipped = 0
        while not should_speculate(policy, state):
            skipped += 1
        skips.append(skipped)
        record_verify(policy, state, 1)  # the probe fails again: 0.5 * 1 + 0.5 * 2 = 1.5 < 2
    assert skips == [2, 4, 8, 8]
    while not should_speculate(policy, state):
        pass
    record_verify(policy, state, 4)  # 0.5 * 4 + 0.5 * 2 = 3 >= 2: pays
    assert state.backoff == 0 and state.tokens_per_step == 3.0
    assert all(should_speculate(policy, state) for _ in range(3))


@pytest.mark.parametrize("field, value", [("min_tokens_per_step", -1.0), ("ema_weight", 0.0),
                                          ("first_backoff", 0), ("max_backoff", 1)])
def test_bad_policy_settings_are_refused(field, value):
    """Each invalid SpecBackoff field raises ValueError naming it."""
    settings = {"min_tokens_per_step": 2.0, "first_backoff": 2, "max_backoff": 8, field: value}
    with pytest.raises(ValueError, match="backoff" if "backoff" in field else field):
        SpecBackoff(**settings)


def _generate_counting_steps(model_dir: str, threshold: float) -> tuple[list[list[int]], int]:
    with LLM(model_dir, attention_backend="torch", spec_block_size=4, spec_min_tokens_per_step=threshold) as llm:
        solo = [llm.generate([prompt], greedy())[0] for prompt in PROMPTS]
        batched = llm.generate(PROMPTS, greedy())
        assert solo == batched
        return solo, llm.acceptance_stats.num_verify_steps


@pytest.mark.slow  # six engines (two models x reference / always / back-off), ~100 short generations
@pytest.mark.parametrize("model", ["deepseek", "k3"])
def test_backing_off_keeps_greedy_output_and_skips_verify_steps(tmp_path, model):
    """With a random (poor) draft and a back-off threshold above what it achieves, outputs (alone and in a
    batch) equal plain greedy decoding while the engine runs fewer verify steps than always speculating;
    on the hybrid K3 model this also mixes plain and verify steps over the KDA state."""
    if model == "k3":
        model_dir = str(make_k3_with_dspark(tmp_path / "k3"))
    else:
        path = make_tiny_checkpoint(tmp_path / "m", "heads24")
        add_random_draft(path, block_size=4)
        model_dir = str(path)
    with LLM(model_dir, attention_backend="torch", draft_model="") as reference:
        expected = reference.generate(PROMPTS, greedy(speculative=False))
    always, always_steps = _generate_counting_steps(model_dir, 0.0)
    backing_off, backoff_steps = _generate_counting_steps(model_dir, 3.5)
    assert always == expected and backing_off == expected
    assert 0 < backoff_steps < always_steps
