"""TP=2 (two processes, gloo) with page tables sent as deltas (engine/runtime/page_table_sync.py), on both embedded
models (pdserve-tiny, K3 tiny: KDA state slots and checkpoints too).

Invariants: over a run with preemption (a pool too small for the batch), an abort, prefix-cache hits and
speculative decoding (draft and verify plans), the TP=2 engine emits exactly the TP=1 engine's greedy tokens,
while the followers were sent a small fraction of the plans' page-table entries; a delta corrupted on its way
is refused by the follower, which leaves the group: the leader's step fails loudly instead of returning
tokens computed on a wrong table."""
from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from engine import SamplingParams
from engine.engine_config import EngineConfig
from engine.paths import DSV3_MODEL_DIR, K3_MODEL_DIR
from engine.runtime import tp_launcher
from engine.runtime.llm_engine import LLMEngine

GREEDY = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)


def _prompt(seed: int, length: int) -> list[int]:
    return torch.randint(3, 3000, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


# 4-token pages, ~45 of them: four running sequences of ~60 tokens need more, so some are preempted. K3 tiny:
# its KDA state slots, their verify scratch and checkpoints take most of the budget, leaving 27 pages and 3 slots
# (a rank holds half of each slot at TP=2 but whole pages: 1.9 MiB per rank gives the same 27 pages and 3 slots).
MODELS = {"pdserve-tiny": (str(DSV3_MODEL_DIR), lambda tp: dict(kv_memory_bytes=45 * 9_990)),
          "k3": (str(K3_MODEL_DIR), lambda tp: dict(kv_memory_bytes=36 * 2**20 // 10 if tp == 1 else 19 * 2**20 // 10,
                                                    state_memory_fraction=0.95, state_checkpoint_interval=16))}


def _config(tp_size: int, model: str = "pdserve-tiny") -> EngineConfig:
    model_dir, options = MODELS[model]
    return EngineConfig(model_dir=model_dir, tp_size=tp_size, attention_backend="torch", page_size=4, max_running=4,
                        max_batched_tokens=32, prefix_cache=True, **options(tp_size))


def _drain(engine: LLMEngine, tokens: dict[str, list[int]], abort_at: dict[int, str]) -> None:
    steps = 0
    while engine.has_work():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        steps += 1
        if steps in abort_at:
            assert engine.abort(abort_at[steps])


def _run(tp_size: int, model: str):
    """Two waves: the second shares prefixes with the first (prefix-cache hits) and loses one request to an abort."""
    base = _prompt(0, 24)
    tokens: dict[str, list[int]] = {}
    with LLMEngine(_config(tp_size, model)) as engine:
        for i in range(3):
            engine.add_request(f"a{i}", _prompt(10 + i, 20 + 5 * i), GREEDY)
        engine.add_request("a3", base + [5, 6, 7], GREEDY)
        _drain(engine, tokens, {})
        for i in range(4):
            engine.add_request(f"b{i}", base + _prompt(20 + i, 6 + i), GREEDY)
        engine.add_request("b4", _prompt(30, 30), GREEDY)
        _drain(engine, tokens, {6: "b2"})
        sender = engine.leader.tables
        stats = ((engine.num_preemptions, engine.allocator.num_pages, engine.num_state_slots),
                 engine.prefix_cache_stats.hit_tokens, sender.pages_sent,
                 sender.pages_in_plans, sender.epoch, engine.num_free_pages == engine.allocator.num_pages)
    return tokens, stats


@pytest.mark.slow  # a TP=2 and a TP=1 run of a tiny model with its draft: ~20 s of CPU
@pytest.mark.parametrize("model", sorted(MODELS))
def test_tp2_with_page_deltas_equals_tp1(model):
    want, (preempted, hits, _, _, _, _) = _run(1, model)
    got, (preempted2, hits2, sent, in_plans, epochs, all_free) = _run(2, model)
    assert preempted[0] > 0 and hits > 0  # the run went through preemption and prefix-cache hits
    assert (preempted2, hits2) == (preempted, hits)  # the same schedule
    assert got == want
    assert len(want["b2"]) < GREEDY.max_new_tokens  # aborted
    assert all_free
    assert epochs > 20 and in_plans > 0
    print(f"\nTP=2 run: {epochs} plans with page tables, {in_plans} page entries in them, {sent} sent "
          f"({in_plans / max(sent, 1):.1f}x fewer)")
    assert sent * 3 < in_plans


@pytest.mark.slow  # one TP=2 engine start: ~10 s of CPU
def test_a_corrupted_delta_fails_the_step_loudly(monkeypatch):
    """Negative control: the leader's checksum of one plan's tables is made wrong on its way out; the follower
    refuses the plan (PageTableDesync) and leaves, so the leader's step raises instead of returning tokens."""
    original = tp_launcher.to_wire
    calls = []

    def corrupting(sender, plan):
        wire = original(sender, plan)
        calls.append(type(wire).__name__)
        if len(calls) == 3 and type(wire).__name__ == "DeltaPlan":
            wire = dataclasses.replace(wire, delta=dataclasses.replace(wire.delta, checksum=wire.delta.checksum + 1))
        return wire

    monkeypatch.setattr(tp_launcher, "to_wire", corrupting)
    engine = LLMEngine(dataclasses.replace(_config(2), prefix_cache=False, draft_model_dir=""))
    try:
        engine.add_request("x", _prompt(1, 12), GREEDY)
        with pytest.raises(RuntimeError) as failure:
            while engine.has_work():
                engine.step()
        assert len(calls) >= 3 and "remote worker" in str(failure.value)  # gloo: the peer is gone
        follower = engine.leader.followers[0]
        deadline = time.monotonic() + 120
        while follower.exit_code() is None and time.monotonic() < deadline:
            time.sleep(0.05)  # polling the follower's exit, not synchronising on time
        assert follower.exit_code() == 1  # it refused the plan (PageTableDesync) and left; nobody killed it
    finally:
        engine.close()
