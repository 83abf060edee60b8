"""Speculation-on/off runs shared by bench_spec and bench_k3_spec: one variant's timed run (tok/s, CPU tok/s,
acceptance length, forward times) and, single stream, the same figures per prompt, with the per-prompt table
(speed-ups taken per round from runs that took turns, so drifts of a shared machine cancel out)."""
from __future__ import annotations

import statistics
import time

from benchmarks.common import ForwardTimer, Metrics, Table, TimedRun, merge_runs, spread, timed_groups, timed_generate
from benchmarks.prompts import BenchPrompt
from engine import LLM, SamplingParams
from engine.spec.spec_policy import SpecBackoff


def acceptance_counts(llm: LLM) -> tuple[int, int]:
    """(verify steps, accepted drafts) since the engine started."""
    stats = llm.acceptance_stats
    return stats.num_verify_steps, stats.num_accepted_drafts


def accept_len(before: tuple[int, int], after: tuple[int, int]) -> float | None:
    """Tokens emitted per verify step between two acceptance_counts (the bonus token included)."""
    steps = after[0] - before[0]
    return (after[1] - before[1] + steps) / steps if steps > 0 else None


def _per_prompt(llm: LLM, prompts: list[list[int]], params: SamplingParams, metrics: Metrics) -> TimedRun:
    """Each prompt alone (single stream), its tok/s, CPU tok/s and acceptance length into metrics[f"{key}/{i}"]."""
    runs = []
    for index, prompt in enumerate(prompts):
        counts, cpu_start = acceptance_counts(llm), time.thread_time()
        run = timed_generate(llm.engine, [prompt], params)
        cpu_seconds = time.thread_time() - cpu_start
        metrics[f"tok_s/{index}"] = run.new_tokens / run.total_s
        metrics[f"cpu_tok_s/{index}"] = run.new_tokens / cpu_seconds if cpu_seconds > 0 else float("nan")
        length = accept_len(counts, acceptance_counts(llm))
        if length is not None:
            metrics[f"accept_len/{index}"] = length
        runs.append(run)
    return merge_runs(runs)


def spec_variant(llm: LLM, prompts: list[list[int]], batch: int, params: SamplingParams, outputs: dict, key: str,
                 timers: tuple[ForwardTimer, ForwardTimer], backoff: float = 0.0):
    """A run (the prompts in groups of `batch`; at batch 1 each prompt's figures too) that also reports the
    acceptance length of its verify steps and the median wall time of its target forwards (decode or verify;
    prefill calls are few) and draft forwards. backoff > 1: the run uses the engine's speculation back-off
    (engine/spec/spec_policy.py) at that many tokens per verify step, as spec_min_tokens_per_step would set it."""

    def run() -> Metrics:
        engine, default = llm.engine, llm.engine.spec_backoff
        engine.spec_backoff = SpecBackoff(backoff)
        try:
            return measured()
        finally:
            engine.spec_backoff = default

    def measured() -> Metrics:
        counts = acceptance_counts(llm)
        for timer in timers:
            timer.take()
        metrics: Metrics = {}
        cpu_start = time.thread_time()
        timed = _per_prompt(llm, prompts, params, metrics) if batch == 1 else timed_groups(llm.engine, prompts,
                                                                                             params, batch)
        cpu_seconds = time.thread_time() - cpu_start
        outputs[key] = timed.outputs
        metrics.update(timed.metrics())
        # At 1 torch thread the engine's work runs on this thread: CPU tok/s is steady on a shared machine.
        metrics["cpu_tok_s"] = timed.new_tokens / cpu_seconds if cpu_seconds > 0 else float("nan")
        target, draft = (timer.take() for timer in timers)
        metrics["target_ms"] = 1e3 * statistics.median(target)
        metrics["draft_ms"] = 1e3 * statistics.median(draft) if draft else 0.0
        length = accept_len(counts, acceptance_counts(llm))
        if length is not None:
            metrics["accept_len"] = length
        return metrics

    return run


def spec_variants(llm: LLM, prompts: list[list[int]], batch: int, new_tokens: int, blocks: list[int],
                  backoffs: list[float], outputs: dict, timers: tuple[ForwardTimer, ForwardTimer]) -> dict:
    """The variants a spec benchmark interleaves (greedy, eos ignored): "off", "B=b" for each block size and
    "B=max back-off t" for each back-off threshold t (the largest block with the engine's back-off)."""
    def params(speculative: bool, block: int | None = None) -> SamplingParams:
        return SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True, speculative=speculative,
                              block_size=block)

    variants = {"off": spec_variant(llm, prompts, batch, params(False), outputs, "off", timers)}
    for block in blocks:
        name = f"B={block}"
        variants[name] = spec_variant(llm, prompts, batch, params(True, block), outputs, name, timers)
    for threshold in backoffs:
        name = f"B={max(blocks)} back-off {threshold:g}"
        variants[name] = spec_variant(llm, prompts, batch, params(True, max(blocks)), outputs, name, timers,
                                      backoff=threshold)
    return variants


def per_prompt_table(title: str, prompts: list[BenchPrompt], off: list[Metrics], on: list[Metrics]) -> tuple[Table, list[float]]:
    """One row per prompt: its kind and place, median tok/s off / on, the CPU speed-up (per round on / off,
    median (min..max) over rounds), the wall speed-up (ratio of medians) and the acceptance length.
    Returns the table and each prompt's median CPU speed-up."""
    table = Table(title, ["#", "kind", "ends at", "off tok/s", "on tok/s", "speed-up", "CPU speed-up (spread)",
                          "accept len"])
    medians = []
    for index, prompt in enumerate(prompts):
        def values(samples: list[Metrics], key: str) -> list[float]:
            return [m[f"{key}/{index}"] for m in samples if f"{key}/{index}" in m]

        off_rate, on_rate = statistics.median(values(off, "tok_s")), statistics.median(values(on, "tok_s"))
        cpu = [a / b for a, b in zip(values(on, "cpu_tok_s"), values(off, "cpu_tok_s"))]
        accepted = values(on, "accept_len")
        medians.append(statistics.median(cpu))
        table.add(index, prompt.kind, prompt.where, off_rate, on_rate, f"{on_rate / off_rate:.2f}x",
                  spread(cpu, unit="x"), statistics.median(accepted) if accepted else float("nan"))
    return table, medians
