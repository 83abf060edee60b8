"""RequestRun over the gateway's PrefillStreams to two real prefill worker servers in this process
(tests/prefill_worker/stream_server.py): when the worker running the prompt dies mid-prefill, its stream
fails the prompt UNAVAILABLE, the worker is marked unreachable and the prompt goes once to the other."""
from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc

from engine.sampling_params import SamplingParams
from gateway.orchestrator import FinishEvent, RequestRun, TokensEvent
from gateway.prefill_stream import PrefillStream
from gateway.requests import GenerateJob
from gateway.router import DecodeLoad, PrefillLoad
from gateway.worker_clients import PrefillWorker, WorkerClient
from gateway.kv_index import Overlap
from rpc.interceptors import token_metadata
from rpc.internal.v1 import worker_pb2, worker_pb2_grpc
from tests.prefill_worker.stream_server import TOKEN, shm_pool, start_worker, stop_worker  # noqa: F401 - fixture
from tests.services.helpers import eventually


class _RetryPool:
    """A WorkerPool stand-in for RequestRun: a standing lease into the shm pool, two prefill workers over
    real streams (the first that is healthy is picked), and a decode stub that finishes at once."""

    def __init__(self, workers: list[PrefillWorker], destination: Any) -> None:
        self.prefill = workers
        self.load = DecodeLoad("decode")  # (this pool is its own decode worker)
        self.metadata = token_metadata(TOKEN)
        self.polled = asyncio.Event()
        self.polled.set()
        self.stub = self
        self._destination = destination
        self.marked: list[str] = []

    def take_standing(self, num_prompt_tokens: int, prompt: Any = None) -> Any:
        return self, self._destination

    def refill_standing(self) -> None:
        pass

    def overlap(self, address: str, prompt: Any) -> Overlap:
        return Overlap()  # (no KV index here)

    def pick_prefill(self, prompt: Any = None) -> PrefillWorker:
        return next(worker for worker in self.prefill if worker.load.healthy)

    def mark_unreachable(self, state: PrefillLoad, error: grpc.aio.AioRpcError) -> None:
        state.healthy = False
        self.marked.append(error.code().name)

    @property
    def stream(self) -> _RetryPool:  # (the decode worker's stream)
        return self

    def submit(self, request: worker_pb2.DecodeRequest, timeout: float | None, trace_id: str = "") -> Any:
        async def chunks():
            yield worker_pb2.DecodeStreamUpdate(token_ids=[1], finished=True, finish_reason="length", decode_steps=1)

        return chunks()


async def test_a_run_whose_prefill_worker_dies_is_answered_by_the_other(shm_pool):
    """RequestRun over two workers' streams: the first dies mid-prefill (UNAVAILABLE), is marked unreachable,
    and the prompt is sent once more, to the second, whose first token reaches the client."""
    first, second = await start_worker(shm_pool), await start_worker(shm_pool)
    first.engine.gate.clear()
    channels, workers = [], []
    for worker in (first, second):
        channel = grpc.aio.insecure_channel(worker.address)
        stream = PrefillStream(worker_pb2_grpc.PrefillServiceStub(channel), token_metadata(TOKEN), worker.address)
        channels.append(channel)
        workers.append(WorkerClient(PrefillLoad(worker.address, healthy=True), channel,
                                     worker_pb2_grpc.PrefillServiceStub(channel), stream))
    destination = first.request("run", [9] * 8).destination
    pool = _RetryPool(workers, destination)
    job = GenerateJob(request_id="run", prompt_ids=(9,) * 8,
                      params=SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True))
    run = RequestRun(job, pool, None, time.perf_counter(), time.monotonic() + 60, cleanup_timeout_s=5.0)  # type: ignore[arg-type]
    try:
        run.start()
        await eventually(lambda: first.engine.started == ["run"], "the prompt to run on the first worker")
        await stop_worker(first)
        events = []
        while not events or not isinstance(events[-1], FinishEvent):
            events.append(await asyncio.wait_for(run.events.get(), 60))
        assert isinstance(events[0], TokensEvent) and events[0].token_ids == [9], events
        assert pool.marked == ["UNAVAILABLE"] and not workers[0].load.healthy
        assert second.engine.started == ["run"]
        assert run.task is not None
        await asyncio.wait_for(run.task, 60)
    finally:
        for worker in workers:
            await worker.stream.close()
        for channel in channels:
            await channel.close()
        await stop_worker(first)
        await stop_worker(second)
