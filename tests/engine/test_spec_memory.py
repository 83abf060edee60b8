"""The cache budget (kv_memory_bytes) covers latent + draft pages, KDA state slots and the speculative verify
scratch (K3_SPEC 5.1: the state after each verify position, per running sequence): speculation at full batch
allocates nothing past it."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.cache.state_pool import StatePool
from tests.engine.dspark_fixtures import make_k3_with_dspark

MAX_RUNNING = 8
BUDGET = 12 * 2**20


def _cache_bytes(engine) -> int:
    """Every byte the leader rank's caches hold: pages (target + draft), slots and the verify scratch."""
    cache, state = engine.runner.cache, engine.state_pool
    tensors = [cache.kv, cache.draft, state.conv, state.recurrent, state.snapshot_conv, state.snapshot_recurrent]
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_k3_with_dspark(tmp_path_factory.mktemp("spec_memory")))


def test_full_batch_speculation_stays_within_the_budget(model_dir, monkeypatch):
    """MAX_RUNNING sequences speculating with block 8 together: the verify scratch is allocated at start for all
    of them, a full-batch verify step uses it without growing it, and pages + slots + scratch <= the budget."""
    steps: list[tuple[int, int]] = []
    begin = StatePool.begin_snapshots

    def record(self, num_seqs, width):
        steps.append((num_seqs, width))
        return begin(self, num_seqs, width)

    monkeypatch.setattr(StatePool, "begin_snapshots", record)
    prompts = [[3 + i, 9, 4 + 2 * i, 7] * (1 + i % 3) for i in range(MAX_RUNNING)]
    params = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True, block_size=8)
    with LLM(model_dir, attention_backend="torch", spec_block_size=8, max_running=MAX_RUNNING,
             kv_memory_bytes=BUDGET, prefix_cache=False) as llm:  # the checkpoint share: test_prefix_cache
        engine = llm.engine
        state = engine.state_pool
        assert state.snapshot_conv is not None and state.snapshot_conv.shape[1:3] == (MAX_RUNNING, 8)
        scratch = state.snapshot_recurrent
        before = _cache_bytes(engine)
        llm.generate(prompts, params)
        assert (MAX_RUNNING, 8) in steps, f"no full-batch verify step: {steps}"
        assert state.snapshot_recurrent is scratch  # served from the budgeted scratch, not regrown
        assert _cache_bytes(engine) == before <= BUDGET
        scratch_bytes = (state.snapshot_conv.numel() * state.snapshot_conv.element_size()
                         + scratch.numel() * scratch.element_size())
        assert scratch_bytes == MAX_RUNNING * 8 * state.shape.bytes_per_slot


def test_budget_too_small_for_the_scratch_is_refused(model_dir):
    """A budget that holds slots but not one sequence's verify scratch is refused at start, naming the budget."""
    with pytest.raises(ValueError, match="kv_memory_bytes=.*verify scratch"):
        LLM(model_dir, attention_backend="torch", spec_block_size=8, kv_memory_bytes=8 * 78_336)
    with LLM(model_dir, attention_backend="torch", draft_model="", kv_memory_bytes=8 * 78_336) as llm:
        assert llm.engine.state_pool.snapshot_conv is None  # no draft: no scratch, the same budget is enough
        assert torch.equal(llm.engine.state_pool.conv, torch.zeros_like(llm.engine.state_pool.conv))
