"""The prefill service's entry point: prompts prefilled into pages chosen by someone else (the decode
worker's shared-memory pools, or this engine's own pool for the grpc transport), in chunks of at most
max_batched_tokens per forward, several prompts per forward; returns each prompt's first token.
Models with linear attention: each job's KDA state runs in its state slot of the same pools (zeroed
before its first chunk), so on shm it ends up straight in the slot decode reserved."""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from engine.engine_types import PrefillJob, PrefillResult
from engine.grammar import new_matcher
from engine.logits_processing import first_token_scores
from engine.prompt_logprobs import logit_spans, prompt_token_logprobs
from engine.sampling import make_generator
from engine.sampling_params import speculates
from engine.step_plan import PrefillItem, prefill_plan, with_state_slots
from engine.sequence import TokenLogprob
from engine.step_results import sample_tokens, token_logprobs

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine


def _group_by_destination(engine: LLMEngine, jobs: list[PrefillJob]) -> dict[tuple[str, ...] | None, list[PrefillJob]]:
    groups: dict[tuple[str, ...] | None, list[PrefillJob]] = {}
    for job in jobs:
        engine.validate_prompt(job.prompt_ids)
        if len(job.page_ids) * engine.config.page_size < len(job.prompt_ids):
            raise ValueError(f"{len(job.page_ids)} pages cannot hold a prompt of {len(job.prompt_ids)} tokens")
        if (engine.state_pool is not None) != (job.state_slot is not None):
            raise ValueError(f"prefill job {job.request_id}: a model with linear attention needs a state slot "
                             "(and one without, none)")
        groups.setdefault(job.pool_names, []).append(job)
    return groups


def run_prefill_jobs(engine: LLMEngine, jobs: list[PrefillJob],
                     should_stop: Callable[[str], bool] | None = None) -> list[PrefillResult | None]:
    """should_stop(request_id), asked before every chunk: True drops that prompt there (its result is
    None; nothing more is written to its pages)."""
    results: dict[str, PrefillResult] = {}
    scored: dict[str, list[TokenLogprob]] = {}  # prompt logprobs so far, per request asking for them
    started = time.perf_counter()
    for pool_names, group in _group_by_destination(engine, jobs).items():
        progress = {job.request_id: 0 for job in group}
        while any(progress[job.request_id] < len(job.prompt_ids) for job in group):
            if should_stop is not None:
                for job in group:
                    if progress[job.request_id] < len(job.prompt_ids) and should_stop(job.request_id):
                        progress[job.request_id] = len(job.prompt_ids)
                if all(progress[job.request_id] == len(job.prompt_ids) for job in group):
                    break
            budget = engine.config.max_batched_tokens
            items, stepping, slots, fresh = [], [], [], []
            for job in group:
                done = progress[job.request_id]
                left = len(job.prompt_ids) - done
                if left == 0 or budget == 0:
                    continue
                take = min(left, budget)
                budget -= take
                items.append(PrefillItem(job.prompt_ids, done, take, job.page_ids, done + take == len(job.prompt_ids),
                                         all_logits=job.params.prompt_logprobs is not None))
                stepping.append((job, take))
                slots.append(job.state_slot)
                if done == 0:
                    fresh.append(job.state_slot)
            plan = prefill_plan(items, pool_names,
                                write_draft_context=speculates([job.params for job, _ in stepping], engine.has_draft))
            if engine.state_pool is not None:  # the KDA state runs in the job's slot (decode's, for shm)
                plan = with_state_slots(plan, slots, tuple(fresh))
            logits = engine.leader.execute(plan)
            finishing = [job for (job, _), item in zip(stepping, items) if item.needs_logits]
            if any(item.all_logits for item in items):  # prompt scoring: every row of those chunks came back
                spans = logit_spans(items)
                for (job, _), item, (row, count) in zip(stepping, items, spans):
                    if item.all_logits:
                        scored.setdefault(job.request_id, []).extend(prompt_token_logprobs(
                            logits[row : row + count], job.prompt_ids, progress[job.request_id], job.params.prompt_logprobs))
                last_rows = [row + count - 1 for (row, count), item in zip(spans, items) if item.needs_logits]
                logits = logits.index_select(0, torch.tensor(last_rows, dtype=torch.long, device=logits.device))
            if finishing:
                generators = [make_generator(job.params.seed, engine.device) for job in finishing]
                matchers = [new_matcher(engine.grammars, *job.params.structured_output) if job.params.structured_output
                            else None for job in finishing]
                scores = first_token_scores([job.params for job in finishing], [job.prompt_ids for job in finishing],
                                            logits, engine.eos_ids, matchers)
                tokens = sample_tokens([job.params for job in finishing], generators, scores)
                for row, job in enumerate(finishing):
                    logprob = None
                    if job.params.logprobs:
                        logprob = token_logprobs(logits[row : row + 1], [tokens[row]], job.params.logprobs)[0]
                    results[job.request_id] = PrefillResult(
                        job.request_id, tokens[row], logprob, len(job.prompt_ids), time.perf_counter() - started,
                        prompt_logprobs=tuple(scored.get(job.request_id, ())),
                    )
            for job, take in stepping:
                progress[job.request_id] += take
    return [results.get(job.request_id) for job in jobs]
