"""The prefill service's entry point: prompts prefilled for another worker, through the engine's own Scheduler.

Each job runs as a prefill-only sequence in this engine's own pages (chunked prefill, several prompts per step, a
prefix-cache hit maps cached pages and restores a KDA checkpoint, exactly as for a local request). When its prompt
is done the engine copies its pages (target and draft context) and, for models with linear attention, its state
slot into the destination the job names - the decode worker's shared-memory pools, or pages of this engine's own
pool for the grpc transport - samples the first token (the engine's one first-token path) and ends the sequence,
so its full pages stay in this engine's prefix cache for the next prompt sharing them."""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

from engine.runtime.outputs import PrefillJob, PrefillResult, StepOutput


class PrefillEngine(Protocol):
    """What run_prefill_jobs uses of LLMEngine."""

    def add_prefill_job(self, job: PrefillJob) -> None: ...

    def check_prefill_job(self, job: PrefillJob) -> None: ...

    def abort(self, request_id: str) -> bool: ...

    def step(self) -> list[StepOutput]: ...


def run_prefill_jobs(engine: PrefillEngine, jobs: list[PrefillJob], should_stop: Callable[[str], bool] | None = None,
                     before_step: Callable[[], None] | None = None) -> list[PrefillResult | None]:
    """Every job is checked before any runs (ValueError naming the bad one). should_stop(request_id), asked before
    every step: True aborts that prompt (its result is None; nothing is written to its destination). before_step():
    called before every step that computes (core lending: rpc/core_board.py PrefillCores)."""
    for job in jobs:
        engine.check_prefill_job(job)
    started = time.perf_counter()
    for index, job in enumerate(jobs):
        try:
            engine.add_prefill_job(job)
        except BaseException:
            for added in jobs[:index]:
                engine.abort(added.request_id)
            _drain(engine, {job.request_id for job in jobs[:index]})
            raise
    pending = {job.request_id for job in jobs}
    stopped: set[str] = set()
    results: dict[str, PrefillResult] = {}
    try:
        while pending:
            if should_stop is not None:
                for request_id in sorted(pending):
                    if should_stop(request_id) and engine.abort(request_id):
                        pending.discard(request_id)
                        stopped.add(request_id)
            if before_step is not None:
                before_step()
            for out in engine.step():
                stopped.discard(out.request_id)
                if out.request_id in pending and out.finished:
                    pending.discard(out.request_id)
                    if out.new_token_ids and out.finish_reason != "abort":
                        results[out.request_id] = PrefillResult(
                            out.request_id, out.new_token_ids[0], out.logprobs[0] if out.logprobs else None,
                            out.num_prompt_tokens, time.perf_counter() - started, out.num_cached_tokens,
                            out.prompt_logprobs)
    except BaseException:
        for request_id in pending:
            engine.abort(request_id)
        _drain(engine, pending | stopped)
        raise
    _drain(engine, stopped)
    return [results.get(job.request_id) for job in jobs]


def _drain(engine: PrefillEngine, request_ids: set[str]) -> None:
    """Collects the aborted sequences' final outputs so the engine forgets them."""
    left = set(request_ids)
    while left:
        outputs = engine.step()
        left -= {out.request_id for out in outputs if out.finished}
        if not outputs:
            break
