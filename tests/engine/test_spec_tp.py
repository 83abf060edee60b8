"""Speculative decoding on a hybrid K3 model at TP=2 (leader + one follower process, gloo): the draft runs on
both ranks, the verify step's KDA snapshots and their commit (CommitStatePlan) reach the follower's half of
the state too, so greedy speculative output equals plain greedy, and every slot and page comes back."""
from __future__ import annotations

import dataclasses

import pytest

from engine import LLM, SamplingParams
from engine.spec import spec_decode
from tests.engine.dspark_fixtures import make_k3_with_dspark
from tests.engine.test_spec_hybrid import oracle_propose

PROMPTS = [[5 + i % 7, 6 + i, 7, 8 + (3 * i) % 11] * (1 + i % 4) for i in range(6)]
GREEDY = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_k3_with_dspark(tmp_path_factory.mktemp("spec_tp")))


@pytest.mark.slow
def test_tp2_greedy_spec_equals_plain_greedy(model_dir, monkeypatch):
    """At TP=2: plain greedy equals TP=1 plain greedy; greedy speculation with the random DSpark draft (block 8,
    batched and alone) and with a draft right up to a random position (every acceptance length, so rejected
    positions sit in the follower's verify step too) emits exactly the plain tokens; nothing is left allocated."""
    with LLM(model_dir, attention_backend="torch", draft_model="") as llm:
        tp1 = llm.generate(PROMPTS, GREEDY)
    with LLM(model_dir, tp_size=2, attention_backend="torch", spec_block_size=8) as llm:
        engine = llm.engine
        plain = llm.generate(PROMPTS, dataclasses.replace(GREEDY, speculative=False))
        assert llm.acceptance_stats.num_verify_steps == 0
        spec_batched = llm.generate(PROMPTS, dataclasses.replace(GREEDY, block_size=8))
        spec_solo = [llm.generate([prompt], dataclasses.replace(GREEDY, block_size=4))[0] for prompt in PROMPTS[:2]]
        assert llm.acceptance_stats.num_verify_steps > 0
        monkeypatch.setattr(spec_decode, "propose", oracle_propose({tuple(p): r for p, r in zip(PROMPTS, plain)}))
        spec_oracle = llm.generate(PROMPTS, dataclasses.replace(GREEDY, block_size=8))
        stats = llm.acceptance_stats
        assert len({k for k, n in enumerate(stats.position_accepted) if n}) >= 3  # partial acceptance happened
        assert engine.state_pool.num_free == engine.state_pool.num_slots
        assert engine.num_free_pages == engine.allocator.num_pages
    assert plain == tp1
    assert spec_batched == plain
    assert spec_solo == plain[:2]
    assert spec_oracle == plain
