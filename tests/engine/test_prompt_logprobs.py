"""Prompt scoring in the prefill entry point (engine/sampling/prompt_logprobs.py): the logprob of every prompt token
after the first, and its top alternatives, equal log_softmax of the engine's own full logits (llm.logits),
whatever the chunking (max_batched_tokens splits prompts across forwards, several prompts per forward, a
scoring prompt beside one that does not score); the first token is sampled as without scoring."""
from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from engine.runtime.llm_engine import EngineConfig, LLMEngine, PrefillJob

PROMPTS = [[5, 6, 7, 8] * 3, list(range(10, 47)), [9], [3, 4]]


@pytest.mark.parametrize("max_batched_tokens", [7, 2048])
def test_prompt_logprobs_equal_the_full_logits(tiny_checkpoint, max_batched_tokens):
    """Each prompt's scored tokens: token id, logprob (1e-4) and the 3 most likely alternatives with their
    logprobs, against log_softmax(full_logits); the non-scoring prompt gets none; first tokens are unchanged."""
    config = EngineConfig(model_dir=str(tiny_checkpoint("heads24")), attention_backend="torch", draft_model_dir="",
                          max_batched_tokens=max_batched_tokens)
    scoring = SamplingParams(max_new_tokens=1, temperature=0, prompt_logprobs=3)
    plain = SamplingParams(max_new_tokens=1, temperature=0)
    with LLMEngine(config) as engine:
        jobs = [PrefillJob(f"r{i}", prompt, plain if i == 1 else scoring, engine.allocate_pages(len(prompt)))
                for i, prompt in enumerate(PROMPTS)]
        results = engine.prefill(jobs)
        for job in jobs:
            engine.free_pages(job.page_ids)
        for job, result in zip(jobs, results):
            full = torch.log_softmax(engine.full_logits(job.prompt_ids).float(), dim=-1)
            assert result.first_token == int(full[-1].argmax())
            if job.params is plain:
                assert result.prompt_logprobs == ()
                continue
            assert [lp.token_id for lp in result.prompt_logprobs] == job.prompt_ids[1:]
            for position, lp in enumerate(result.prompt_logprobs):
                row = full[position]
                assert abs(lp.logprob - float(row[job.prompt_ids[position + 1]])) < 1e-4
                values, ids = row.topk(3)
                assert lp.top_ids == ids.tolist()
                assert torch.allclose(torch.tensor(lp.top_logprobs), values, atol=1e-4)


def test_offline_requests_refuse_prompt_logprobs(tiny_checkpoint):
    """The engine's own path (add_request) does not score prompts: asking is a ValueError naming the field, not a
    silently missing answer."""
    config = EngineConfig(model_dir=str(tiny_checkpoint("heads24")), attention_backend="torch", draft_model_dir="")
    with LLMEngine(config) as engine:
        with pytest.raises(ValueError, match="prompt_logprobs"):
            engine.add_request("r", [5, 6, 7], SamplingParams(max_new_tokens=2, prompt_logprobs=1))
        assert not engine.has_work()
