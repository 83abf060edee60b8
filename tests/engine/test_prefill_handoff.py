"""The disaggregated path inside the engine: a prefill engine writes a prompt's KV and draft context
straight into pages of a decode engine's shared-memory pool; the decode engine continues from there and
produces exactly what one engine produces alone."""
from __future__ import annotations

import pytest

from engine import SamplingParams
from engine.llm_engine import EngineConfig, LLMEngine, PrefillJob
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
