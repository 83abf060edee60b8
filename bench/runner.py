"""One `pdserve bench` invocation: connect, build the workload, warm up, run each concurrency, report."""
from __future__ import annotations

import datetime
import logging
import sys
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, TextIO

import aiohttp
import grpc

from bench.client import GatewayClient, ModelSummary, SamplingOptions
from bench.config import BenchConfig
from bench.load import LoadPlan, run_load
from bench.metrics import compute_metrics
from bench.openai_client import OpenAIClient
from bench.plot import plot_sweep
from bench.progress import ProgressBar
from bench.report import append_jsonl, format_summary
from bench.workload import BenchRequest, WorkloadError, dataset_requests, random_requests

logger = logging.getLogger("bench")


class BenchError(RuntimeError):
    """The benchmark could not produce a result (e.g. warm-up failed); the message is one line."""


def build_workload(config: BenchConfig, info: ModelSummary) -> list[BenchRequest]:
    if config.dataset is not None:
        return dataset_requests(config.dataset, config.num_prompts, config.output_len, config.effective_ignore_eos)
    if info.vocab_size <= 0:
        raise WorkloadError("the server did not report its vocabulary size (needed for random token prompts); use --dataset")
    if info.max_context and config.input_len + config.output_len > info.max_context:
        raise WorkloadError(
            f"--input-len {config.input_len} + --output-len {config.output_len} exceeds the model's "
            f"context of {info.max_context} tokens"
        )
    return random_requests(
        config.num_prompts, config.input_len, config.output_len, info.vocab_size,
        special_ids=info.eos_token_ids, range_ratio=config.range_ratio, seed=config.seed,
        ignore_eos=config.effective_ignore_eos,
    )


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
    }


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
        settings = run_settings(config, sampling, info)
        await warm_up(client, requests, config.warmup_requests, config.concurrencies[0])
        results = []
        for concurrency in config.concurrencies:
            label = f"concurrency {concurrency or 'unbounded'}"
            progress = ProgressBar(len(requests), label=label) if config.progress else None
            plan = LoadPlan(concurrency, config.request_rate, config.burstiness, config.seed)
            on_done = (lambda record: progress.update(failed=not record.success)) if progress else None
            outcome = await run_load(requests, client.send, plan, on_done)
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
