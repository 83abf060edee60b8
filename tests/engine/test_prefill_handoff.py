"""The disaggregated path inside the engine: a prefill engine writes a prompt's KV and draft context
straight into pages of a decode engine's shared-memory pool; the decode engine continues from there and
produces exactly what one engine produces alone."""
from __future__ import annotations

import pytest

from engine import SamplingParams
from engine.runtime.llm_engine import EngineConfig, LLMEngine, PrefillJob
from kvtransfer.shm_pool import ShmPoolFactory
from tests.engine.spec_fixtures import add_random_draft, make_tiny_checkpoint

PROMPTS = [[5, 6, 7, 8] * 3, list(range(10, 60)), [9]]


def _run_alone(engine: LLMEngine, prompts, params) -> list[list[int]]:
    for index, prompt in enumerate(prompts):
        engine.add_request(f"alone-{index}", prompt, params)
    outputs: dict[str, list[int]] = {}
    while engine.has_work():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
    return [outputs[f"alone-{index}"] for index in range(len(prompts))]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    """The heads24 tiny checkpoint with a random block-4 draft, written once for both parametrisations."""
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("handoff") / "m", "heads24")
    add_random_draft(path, block_size=4)
    return path


@pytest.mark.parametrize("params", [
    SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True),
    SamplingParams(max_new_tokens=24, temperature=0.8, top_k=40, seed=7, ignore_eos=True),
], ids=["greedy", "seeded-sampling"])
def test_prefill_into_shared_pool_then_decode_equals_one_engine(model_dir, params):
    """Prefill engine -> decode engine's shm pages -> add_prefilled gives the single-engine tokens
    (greedy and seeded sampling, with speculative decoding), and every page returns to the pool."""
    common = dict(model_dir=str(model_dir), attention_backend="torch", spec_block_size=4, max_batched_tokens=16,
                  page_pools=ShmPoolFactory())
    with LLMEngine(EngineConfig(**common, kv_pool="shm")) as decode, LLMEngine(EngineConfig(**common)) as prefill:
        expected = _run_alone(decode, PROMPTS, params)
        baseline = decode.num_free_pages
        jobs = []
        for index, prompt in enumerate(PROMPTS):
            pages = decode.allocate_pages(len(prompt) + 1)
            jobs.append(PrefillJob(f"r{index}", prompt, params, pages, pool_names=decode.pool_names))
        results = prefill.prefill(jobs)
        for job, result in zip(jobs, results):
            assert result.num_prompt_tokens == len(job.prompt_ids)
            decode.add_prefilled(job.request_id, job.prompt_ids, result.first_token, job.page_ids, params)
        outputs: dict[str, list[int]] = {f"r{index}": [] for index in range(len(PROMPTS))}
        while decode.has_work():
            for out in decode.step():  # the first StepOutput of a request starts with its first token
                outputs[out.request_id].extend(out.new_token_ids)
        got = [outputs[f"r{index}"] for index in range(len(PROMPTS))]
        assert decode.num_free_pages == baseline
    assert [out[0] for out in got] == [result.first_token for result in results]
    assert got == expected


def test_k3_prefill_runs_the_kda_state_in_decodes_slot(tmp_path):
    """Kimi K3 with its DSpark draft: the prefill engine runs each prompt's KDA state in a slot of its own
    (max_batched_tokens 16: several chunks, the state carried between them) and copies it into the state slot the
    decode engine reserved in its shared pool; the decode engine continues from there with speculation and
    produces exactly the single-engine greedy tokens; every page and every state slot returns to the pool. (TP=2: two TP groups
    cannot share one process; tests/services/test_k3_handoff.py runs it across processes.)"""
    from tests.engine.dspark_fixtures import make_k3_with_dspark

    model_dir = make_k3_with_dspark(tmp_path / "k3")
    params = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    common = dict(model_dir=str(model_dir), attention_backend="torch", max_batched_tokens=16,
                  page_pools=ShmPoolFactory(), kv_memory_bytes=16 * 2**20, max_running=8)
    with LLMEngine(EngineConfig(**common, kv_pool="shm")) as decode, LLMEngine(EngineConfig(**common)) as prefill:
        assert decode.state_pool is not None and decode.has_draft
        expected = _run_alone(decode, PROMPTS, params)
        baseline = (decode.num_free_pages, decode.num_free_state_slots)
        jobs = []
        for index, prompt in enumerate(PROMPTS):
            pages, slot = decode.allocate_reservation(len(prompt) + 1)
            jobs.append(PrefillJob(f"r{index}", prompt, params, pages, decode.pool_names, slot))
        results = prefill.prefill(jobs)
        assert prefill.num_free_state_slots == prefill.num_state_slots  # its own slots all given back
        for job, result in zip(jobs, results):
            decode.add_prefilled(job.request_id, job.prompt_ids, result.first_token, job.page_ids, params,
                                 job.state_slot)
        outputs: dict[str, list[int]] = {f"r{index}": [] for index in range(len(PROMPTS))}
        while decode.has_work():
            for out in decode.step():
                outputs[out.request_id].extend(out.new_token_ids)
        assert (decode.num_free_pages, decode.num_free_state_slots) == baseline
    assert [outputs[f"r{index}"] for index in range(len(PROMPTS))] == expected


@pytest.mark.parametrize("model", ["pdserve-tiny", "pdserve-k3-tiny"])
def test_prefill_engine_reuses_its_prefix_cache(model):
    """The embedded models (each with its draft): a second prefill job sharing 150 tokens with the first maps the
    prefill engine's 9 cached full pages (K3: the first prompt's last page boundary, 144, is checkpointed) and computes only the rest, the decode engine
    continues from the copied pages (and state) with the single-engine tokens; every decode page and slot comes
    back, and the prefill engine holds no page but cached ones."""
    from engine.paths import MODELS_DIR

    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    common = dict(model_dir=str(MODELS_DIR / model), page_pools=ShmPoolFactory(), kv_memory_bytes=32 * 2**20,
                  max_batched_tokens=64)
    shared = [3 + (7 * i) % 2000 for i in range(150)]
    prompts = [shared + [11, 12, 13, 14, 15], shared + [21, 22]]
    with LLMEngine(EngineConfig(**common, kv_pool="shm", prefix_cache=False)) as decode, \
            LLMEngine(EngineConfig(**common)) as prefill:
        expected = _run_alone(decode, prompts, params)
        baseline = (decode.num_free_pages, decode.num_free_state_slots)
        cached = []
        for index, prompt in enumerate(prompts):
            pages, slot = decode.allocate_reservation(len(prompt) + 1)
            job = PrefillJob(f"r{index}", prompt, params, pages, decode.pool_names, slot)
            [result] = prefill.prefill([job])
            cached.append(result.num_cached_tokens)
            decode.add_prefilled(job.request_id, prompt, result.first_token, pages, params, slot)
            outputs = []
            while decode.has_work():
                for out in decode.step():
                    outputs.extend(out.new_token_ids)
            assert outputs == expected[index]
        assert cached == [0, 144]
        assert (decode.num_free_pages, decode.num_free_state_slots) == baseline
        assert prefill.num_free_pages == prefill.allocator.num_pages
        assert prefill.prefix_cache_stats.hit_tokens == cached[1]
