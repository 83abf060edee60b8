"""Few state slots and few pages under many speculating K3 requests: no recompute thrash. A sequence that lost
its cache (preempted, or its partial prefill reclaimed) is readmitted only when it and every running sequence
fit to their max_new_tokens, so each sequence is recomputed at most once and the run ends in a bounded number
of steps (counted, never timed); slots and pages are only ever held together and all come back."""
from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from engine.runtime.scheduler import ScheduledStep
from tests.engine.dspark_fixtures import make_k3_with_dspark

SLOT_BYTES, PAGE_BYTES = 78_336, 3_200  # this K3's state slot (6 KDA layers, fp32) and a page of 4 tokens
MAX_NEW = 24


@pytest.mark.slow  # ~200 engine steps of a tiny K3 with its draft
def test_few_slots_many_requests_finish_in_bounded_steps(tmp_path):
    """10 requests, 3 running at most, 4 slots, 30 pages of 4 tokens (one sequence needs up to 20), prefill
    chunks of 16: every request gets its max_new_tokens; no sequence is prefilled for more than its prompt plus
    one recompute of prompt + generated tokens; the steps are at most (tokens prefilled, each step >= 1) +
    (tokens generated) + one empty decode step per sequence; every step's slot holders hold pages and
    vice versa; afterwards every page and slot is free."""
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randrange(20, 50))] for _ in range(10)]
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, block_size=8)
    budget = (4 + 3 * 8) * SLOT_BYTES + 30 * PAGE_BYTES  # 4 slots + verify scratch for 3 x 8 positions
    model_dir = make_k3_with_dspark(tmp_path)
    with LLM(str(model_dir), attention_backend="torch", spec_block_size=8, max_running=3, page_size=4,
             kv_memory_bytes=budget, state_memory_fraction=0.97, max_batched_tokens=16,
                 prefix_cache=False) as llm:  # the cache-off memory split
        engine = llm.engine
        assert engine.allocator.num_pages == 30 and engine.state_pool.num_slots == 4
        prefilled = {f"r{i}": 0 for i in range(len(prompts))}
        schedule = engine.scheduler.schedule

        def counting_schedule() -> ScheduledStep:
            step = schedule()
            for chunk in step.prefill:
                prefilled[chunk.seq.request_id] += chunk.num_tokens
            for seq in [*engine.scheduler.running, *engine.scheduler.waiting]:
                assert (seq.state_slot is None) == (not seq.page_table.pages), f"{seq.request_id} holds one of two"
            return step

        engine.scheduler.schedule = counting_schedule
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, params)
        outputs: dict[str, list[int]] = {rid: [] for rid in prefilled}
        bound = sum(2 * len(p) + MAX_NEW for p in prompts) + len(prompts) * MAX_NEW + len(prompts)
        steps = 0
        while engine.has_work():
            assert steps < bound, f"{steps} steps and still running (bound {bound})"
            for out in engine.step():
                outputs[out.request_id].extend(out.new_token_ids)
            steps += 1
        assert all(len(tokens) == MAX_NEW for tokens in outputs.values())
        for i, prompt in enumerate(prompts):
            assert prefilled[f"r{i}"] <= 2 * len(prompt) + MAX_NEW, f"r{i} recomputed more than once: {prefilled}"
        assert engine.state_pool.num_free == engine.state_pool.num_slots
        assert engine.num_free_pages == engine.allocator.num_pages
        assert engine.num_preemptions > 0, "the pool was large enough that nothing was preempted"
