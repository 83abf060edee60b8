"""Kimi K3's speculative verify steps as captured graphs (engine/runtime/cuda_graphs.py), checked on the CPU.

A CPU has no CUDA graphs, so torch.cuda's graph runtime is replaced (test_fake_cuda's stand-in) and each
captured step's replay runs its step function again over the same static inputs (the packed buffer, the
persistent block table, the fixed snapshot scratch): what a replay computes, minus the launch savings.
Attention runs on the Triton kernels (interpreted), the graph-safe backend: the torch backend reads host-side
lengths and is never captured. Invariants: with verify graphs, K3 tiny with its DSpark draft emits exactly the
eager engine's greedy tokens, and verify graphs (several tokens per sequence, per-position state into the
snapshot scratch, padding rows on a scratch slot) are the ones replayed; a verify graph that would write past
the snapshot scratch, or into one that may move (not fixed at start-up), is never captured (no memory spent on
graphs that could never replay)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from engine import SamplingParams
from engine.engine_config import EngineConfig
from engine.paths import K3_MODEL_DIR
from engine.runtime.cuda_graphs import CudaGraphRunner
from engine.runtime.llm_engine import LLMEngine
from tests.engine.test_fake_cuda import _fake_graph_runtime

GREEDY = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)
PROMPTS = {f"v{i}": [3 + i, 6, 2, 9, 11 + i, 4] for i in range(3)}


def _rerun_replays(graphs: CudaGraphRunner, replays: dict) -> None:
    for key, captured in graphs.steps.items():
        def replay(key=key, captured=captured) -> None:
            replays[key] = replays.get(key, 0) + 1
            with torch.inference_mode():
                captured.logits.copy_(captured.run())
        captured.graph.replay = replay


def _config() -> EngineConfig:
    return EngineConfig(model_dir=str(K3_MODEL_DIR), attention_backend="triton", kv_memory_bytes=32 * 2**20,
                        max_running=4, prefix_cache=False, spec_block_size=4)


def _generate(engine: LLMEngine) -> dict[str, list[int]]:
    """The prompts speculating (verify steps), then again without speculation (plain decode steps)."""
    tokens: dict[str, list[int]] = {}
    for params, tag in ((GREEDY, "spec"), (dataclasses.replace(GREEDY, speculative=False), "plain")):
        for rid, prompt in PROMPTS.items():
            engine.add_request(f"{rid}-{tag}", prompt, params)
        while engine.has_work():
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


@pytest.mark.slow  # K3 tiny with its draft (Triton kernels interpreted), twice: ~60 s of CPU
def test_k3_verify_graphs_replay_the_eager_tokens(monkeypatch):
    with LLMEngine(_config()) as engine:
        assert engine.has_draft and engine.runner.cache.state.fixed_snapshots
        want = _generate(engine)
    _fake_graph_runtime(monkeypatch)
    with LLMEngine(_config()) as engine:
        runner = engine.runner
        scratch = runner.config.num_state_slots - 1  # handed out to none of the three requests
        q_lens = runner.config.graph_query_lens
        assert q_lens[-1] > 1
        runner.graphs = CudaGraphRunner(runner, 4, q_lens, max_pages=16, scratch_state_slot=scratch)
        runner.graphs.capture(write_draft=True)
        assert {q for _, q in runner.graphs.steps} == set(q_lens)
        replays: dict = {}
        _rerun_replays(runner.graphs, replays)
        got = _generate(engine)
        assert scratch not in {seq.state_slot for seq in engine.scheduler.running}
    assert got == want
    assert sum(count for (_, q), count in replays.items() if q > 1) >= 3  # verify steps replayed graphs
    assert sum(count for (_, q), count in replays.items() if q == 1) >= 1


@pytest.mark.slow  # one K3 tiny engine start: ~5 s of CPU
def test_no_verify_graph_without_a_fixed_snapshot_scratch(monkeypatch):
    _fake_graph_runtime(monkeypatch)
    with LLMEngine(_config()) as engine:
        runner = engine.runner
        state = runner.cache.state
        rows = state.snapshot_conv.shape[1]
        graphs = CudaGraphRunner(runner, rows + 1, (1, 3), max_pages=16,
                                 scratch_state_slot=runner.config.num_state_slots - 1)
        graphs.capture(write_draft=True)
        # the largest bucket's verify graph would write past the scratch: not captured, plain decode still is
        assert (rows + 1, 1) in graphs.steps and (rows + 1, 3) not in graphs.steps and (rows, 3) in graphs.steps
        monkeypatch.setattr(state, "fixed_snapshots", False)  # a scratch that may grow (move) at run time
        graphs = CudaGraphRunner(runner, 2, (1, 3), max_pages=16, scratch_state_slot=runner.config.num_state_slots - 1)
        graphs.capture(write_draft=True)
        assert set(graphs.steps) == {(1, 1), (2, 1)}
