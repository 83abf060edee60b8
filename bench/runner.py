"""One `pdserve bench` invocation: connect, build the workload, warm up, run each concurrency, report."""
from __future__ import annotations

import datetime
import logging
import sys
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, TextIO

import aiohttp
import grpc

from bench.client import GatewayClient, ModelSummary, SamplingOptions
from bench.config import BenchConfig
from bench.conversations import run_conversations
from bench.load import LoadPlan, LoadResult, run_load
from bench.metrics import compute_metrics
from bench.openai_client import OpenAIClient
from bench.plot import plot_sweep
from bench.prefix_workloads import ConversationScript, shared_prefix_requests
from bench.progress import ProgressBar
from bench.record import RequestRecord
from bench.report import append_jsonl, format_summary
from bench.workload import BenchRequest, WorkloadError, dataset_requests, random_requests, usable_tokens

logger = logging.getLogger("bench")


class BenchError(RuntimeError):
    """The benchmark could not produce a result (e.g. warm-up failed); the message is one line."""


def build_workload(config: BenchConfig, info: ModelSummary) -> list[BenchRequest]:
    """The requests of a run (random, dataset, shared-prefix); none for multi-turn, whose turns are built while
    it runs (build_script)."""
    if config.dataset is not None:
        return dataset_requests(config.dataset, config.num_prompts, config.output_len, config.effective_ignore_eos)
    if info.vocab_size <= 0:
        raise WorkloadError("the server did not report its vocabulary size (needed for random token prompts); use --dataset")
    longest = _longest_prompt(config)
    if info.max_context and longest + config.output_len > info.max_context:
        raise WorkloadError(
            f"the workload's longest prompt ({longest} tokens) + --output-len {config.output_len} exceeds the "
            f"model's context of {info.max_context} tokens"
        )
    if config.workload == "multi-turn":
        return []
    if config.workload == "shared-prefix":
        return shared_prefix_requests(
            config.num_prompts, config.shared_prefix, config.output_len, usable_tokens(info.vocab_size, info.eos_token_ids),
            config.range_ratio, config.seed, config.effective_ignore_eos)
    return random_requests(
        config.num_prompts, config.input_len, config.output_len, info.vocab_size,
        special_ids=info.eos_token_ids, range_ratio=config.range_ratio, seed=config.seed,
        ignore_eos=config.effective_ignore_eos,
    )


def _longest_prompt(config: BenchConfig) -> int:
    if config.workload == "shared-prefix":
        return config.shared_prefix.prefix_len + config.shared_prefix.suffix_len
    if config.workload == "multi-turn":  # every turn's message, and every answer but the last
        turns = config.conversation.turns
        return config.conversation.system_len + turns * config.input_len + (turns - 1) * config.output_len
    return config.input_len


def build_script(config: BenchConfig, info: ModelSummary) -> ConversationScript:
    return ConversationScript(config.conversation, config.input_len, config.output_len,
                              usable_tokens(info.vocab_size, info.eos_token_ids), config.range_ratio, config.seed)


async def measure(config: BenchConfig, client: GatewayClient | OpenAIClient, requests: list[BenchRequest],
                  script: ConversationScript | None, concurrency: int | None,
                  on_done: Callable[[RequestRecord], None] | None) -> LoadResult:
    """One measured run: the multi-turn script's conversations, or the request list on the load plan."""
    if script is not None:
        return await run_conversations(script, client.send, concurrency, config.effective_ignore_eos, on_done)
    plan = LoadPlan(concurrency, config.request_rate, config.burstiness, config.seed)
    return await run_load(requests, client.send, plan, on_done)


def run_settings(config: BenchConfig, sampling: SamplingOptions, info: ModelSummary) -> dict[str, Any]:
    """The JSON line's description of the run (sglang/vllm names where they have one)."""
    random = config.dataset is None
    return {
        "backend": config.backend,
        "model": info.model,
        "gateway": config.base_url if config.backend == "openai" else config.gateway,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "dataset_name": config.dataset_name,
        "dataset_path": None if random else str(config.dataset),
        "num_prompts": config.num_prompts,
        "random_input_len": config.input_len if random else None,
        "random_output_len": config.output_len if random else None,
        "random_range_ratio": config.range_ratio if random else None,
        "ignore_eos": config.effective_ignore_eos,
        "seed": config.seed,
        "request_rate": config.request_rate,
        "burstiness": config.burstiness,
        "warmup_requests": config.warmup_requests,
        "temperature": sampling.temperature,
        "speculative": sampling.speculative,
        "block_size": sampling.block_size,
        "gpus": config.gpus,
        "gpu_price": config.gpu_price,
        "slo": config.slo.bounds if config.slo else None,
        "workload": config.workload,
        **_workload_settings(config),
    }


def _workload_settings(config: BenchConfig) -> dict[str, Any]:
    if config.workload == "shared-prefix":
        shape = config.shared_prefix
        return {"num_prefixes": shape.num_prefixes, "prefix_min_len": shape.prefix_min_len,
                "prefix_len": shape.prefix_len, "suffix_len": shape.suffix_len}
    if config.workload == "multi-turn":
        shape = config.conversation
        return {"conversations": shape.conversations, "turns": shape.turns, "think_time_s": shape.think_time_s,
                "system_prompt_len": shape.system_len}
    return {}


@asynccontextmanager
async def open_client(config: BenchConfig, sampling: SamplingOptions) -> AsyncIterator[tuple[Any, str]]:
    """(client, its address): GatewayClient over one gRPC channel, or OpenAIClient over one HTTP session
    (no connection limit, so --max-concurrency is the only cap)."""
    if config.backend == "openai":
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            yield OpenAIClient(session, config.base_url, sampling), config.base_url
    else:
        async with grpc.aio.insecure_channel(config.gateway) as channel:
            yield GatewayClient(channel, sampling), config.gateway


async def warm_up(client: GatewayClient | OpenAIClient, requests: list[BenchRequest], count: int, concurrency: int | None) -> None:
    if count == 0:
        return
    batch = [requests[index % len(requests)] for index in range(count)]
    result = await run_load(batch, client.send, LoadPlan(max_concurrency=concurrency))
    failures = [record.error for record in result.records if not record.success]
    if failures:
        raise BenchError(f"{len(failures)} of {count} warm-up requests failed, first: {failures[0]}")


async def run_benchmark(config: BenchConfig, sampling: SamplingOptions, stdout: TextIO | None = None) -> list[dict]:
    """Returns one result dict per concurrency (the JSON lines). Raises GatewayUnreachable,
    WorkloadError or BenchError with one-line messages. The summaries go to stdout (default sys.stdout)."""
    stdout = stdout if stdout is not None else sys.stdout
    async with open_client(config, sampling) as (client, address):
        info = await client.model_info(address, config.connect_timeout_s)
        requests = build_workload(config, info)
        script = build_script(config, info) if config.workload == "multi-turn" else None
        settings = run_settings(config, sampling, info)
        # a prefix workload warms up on unrelated random prompts, so that its first requests stay misses
        warm = requests if config.workload == "random" else random_requests(
            max(1, config.warmup_requests), min(config.input_len, 256), config.output_len, info.vocab_size,
            info.eos_token_ids, seed=config.seed + 1, ignore_eos=config.effective_ignore_eos)
        await warm_up(client, warm, config.warmup_requests, config.concurrencies[0])
        results = []
        for concurrency in config.concurrencies:
            label = f"concurrency {concurrency or 'unbounded'}"
            progress = ProgressBar(config.num_requests if script else len(requests), label=label) if config.progress else None
            on_done = (lambda record: progress.update(failed=not record.success)) if progress else None
            outcome = await measure(config, client, requests, script, concurrency, on_done)
            if progress:
                progress.close()
            for error, count in Counter(r.error for r in outcome.records if not r.success).most_common(3):
                logger.warning("%d request(s) failed: %s", count, error)
            metrics = compute_metrics(outcome.records, outcome.duration_s, config.gpus, config.gpu_price, config.slo)
            result = {**settings, "max_concurrency": concurrency, **metrics.to_json_dict()}
            stdout.write(format_summary(result) + "\n")
            stdout.flush()
            if config.output_file is not None:
                append_jsonl(config.output_file, result)
            results.append(result)
    if config.plot is not None:
        plot_sweep(results, config.plot, title=f"pdserve bench: {info.model}")
    return results
