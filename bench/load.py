"""Load generation: when each request is sent (Poisson / gamma arrivals) and how many run at once."""
from __future__ import annotations

import asyncio
import contextlib
import math
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, NamedTuple

import numpy as np

from bench.record import RequestRecord
from bench.workload import BenchRequest

SendFn = Callable[[BenchRequest], Awaitable[RequestRecord]]


@dataclass(frozen=True)
class LoadPlan:
    """max_concurrency None = unbounded. request_rate inf = send everything at once; otherwise
    inter-arrival gaps are gamma(shape=burstiness, mean=1/request_rate): burstiness 1 is a Poisson
    process, < 1 burstier, > 1 more even (the same convention as sglang's and vllm's benchmarks)."""

    max_concurrency: int | None = None
    request_rate: float = math.inf
    burstiness: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_concurrency is not None and self.max_concurrency <= 0:
            raise ValueError(f"max concurrency must be positive, got {self.max_concurrency}")
        if math.isnan(self.request_rate) or self.request_rate <= 0:
            raise ValueError(f"request rate must be positive (or inf), got {self.request_rate}")
        if not math.isfinite(self.burstiness) or self.burstiness <= 0:
            raise ValueError(f"burstiness must be positive and finite, got {self.burstiness}")


class LoadResult(NamedTuple):
    records: list[RequestRecord]
    duration_s: float


def arrival_gaps(count: int, request_rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """[count] seconds between consecutive sends; mean 1/request_rate, coefficient of variation
    1/sqrt(burstiness). All zeros for an infinite rate."""
    if math.isinf(request_rate):
        return np.zeros(count)
    return rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=count)


def send_offsets(count: int, plan: LoadPlan) -> np.ndarray:
    """[count] send times in seconds after the start: the first request goes at 0."""
    gaps = arrival_gaps(count, plan.request_rate, plan.burstiness, np.random.default_rng(plan.seed))
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])]) if count else np.zeros(0)


async def run_load(
    requests: list[BenchRequest],
    send: SendFn,
    plan: LoadPlan,
    on_done: Callable[[RequestRecord], None] | None = None,
) -> LoadResult:
    """Send every request on schedule, at most plan.max_concurrency in flight; wait for all.
    Records come back in request order with start_s relative to the run's start; duration is
    run start -> last completion."""
    limit = asyncio.Semaphore(plan.max_concurrency) if plan.max_concurrency else contextlib.nullcontext()
    start = time.perf_counter()

    async def one(request: BenchRequest) -> RequestRecord:
        async with limit:
            sent = time.perf_counter() - start
            record = await send(request)
        record.start_s = sent
        if on_done is not None:
            on_done(record)
        return record

    tasks = []
    for request, offset in zip(requests, send_offsets(len(requests), plan)):
        delay = start + float(offset) - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(request)))
    records = list(await asyncio.gather(*tasks))
    return LoadResult(records, time.perf_counter() - start)
