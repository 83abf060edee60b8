"""Mixed steps (engine/runtime/scheduler.py, ForwardMode.MIXED): with prefill_tokens_while_decoding a decode step
and the bounded prefill chunks of prompts arriving meanwhile run as one forward. Greedy outputs equal those of the
alternating steps (mixed_steps off), for a DeepSeek-V3-shaped model and for K3 (KDA state + gated MLA); the steps
were really mixed, every running sequence got a token in each of them, and every page and slot comes back."""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.runtime.forward_batch import ForwardMode
from engine.runtime.step_plan import TargetPlan

GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
FIRST = list(range(40, 70))
LATER = [[(7 * i + 3) % 250 + 3 for i in range(45)], [(11 * i + 5) % 250 + 3 for i in range(23)]]


def _run(model: str, mixed: bool, tp_size: int = 1) -> tuple[dict[str, list[int]], list[tuple[ForwardMode, int]]]:
    """One request decoding; two more join after its second token (prefilled 8 tokens per step beside it).
    Returns the tokens of each and (mode, sequences decoding) of every target forward."""
    with LLM(model, attention_backend="torch", draft_model="", page_size=4, max_running=8, prefix_cache=False,
             prefill_tokens_while_decoding=8, mixed_steps=mixed, tp_size=tp_size) as llm:
        engine = llm.engine
        execute, plans = engine.leader.execute, []

        def recording(plan):
            if isinstance(plan, TargetPlan):
                plans.append((plan.mode, plan.decode_seqs if plan.mode == ForwardMode.MIXED else
                              (len(plan.q_lens) if plan.mode == ForwardMode.DECODE else 0)))
            return execute(plan)

        engine.leader.execute = recording
        outputs: dict[str, list[int]] = {"first": []}
        engine.add_request("first", FIRST, GREEDY)
        while len(outputs["first"]) < 2:
            for out in engine.step():
                outputs[out.request_id].extend(out.new_token_ids)
        for i, prompt in enumerate(LATER):
            outputs[f"later{i}"] = []
            engine.add_request(f"later{i}", prompt, GREEDY)
        while engine.has_work():
            for out in engine.step():
                outputs[out.request_id].extend(out.new_token_ids)
        assert engine.num_free_pages == engine.allocator.num_pages
        if engine.state_pool is not None:
            assert engine.state_pool.num_free == engine.state_pool.num_slots
        return outputs, plans


@pytest.mark.parametrize("model", ["models/pdserve-tiny", "models/pdserve-k3-tiny"])
def test_mixed_steps_give_the_alternating_steps_tokens(model):
    mixed, mixed_plans = _run(model, True)
    alternating, alternating_plans = _run(model, False)
    assert mixed == alternating
    assert all(len(tokens) == GREEDY.max_new_tokens for tokens in mixed.values())
    assert ForwardMode.MIXED not in [mode for mode, _ in alternating_plans]
    mixed_steps = [decoding for mode, decoding in mixed_plans if mode == ForwardMode.MIXED]
    # 45 + 23 prompt tokens at 8 per step beside "first": 9 mixed steps, and no prefill step runs on its own then
    assert len(mixed_steps) == 9 and all(decoding >= 1 for decoding in mixed_steps)
    assert len(mixed_plans) < len(alternating_plans)  # the chunks' steps were also decode steps


def test_mixed_steps_over_two_tensor_parallel_ranks():
    """The MIXED plan travels to a follower rank (page-table deltas, decode_seqs) and gives TP=1's tokens."""
    model = "models/pdserve-k3-tiny"
    assert _run(model, True, tp_size=2)[0] == _run(model, False)[0]
