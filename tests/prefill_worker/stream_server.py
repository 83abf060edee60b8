"""A prefill worker's gRPC server in the test's process, for the PrefillStream tests (worker and gateway
side): the real servicer and PrefillService over a fake engine (its first token is the prompt's first id; a
`gate` holds every prefill until set), writing into one real shm pool the test reserves pages in, as a
decode worker would."""
from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from engine.runtime.outputs import PrefillJob
from engine.cache.kv_cache import PageAllocator
from engine.sampling_params import SamplingParams
from engine.runtime.llm_engine import PrefillResult
from kvtransfer.layout import KVLayout
from kvtransfer.leases import LeaseTable
from kvtransfer.shm_pool import SharedPagePool
from kvtransfer.shm_receiver import ShmReceiver
from prefill_worker.config import PrefillWorkerConfig
from prefill_worker.service import PrefillService
from prefill_worker.servicer import PrefillServicer
from rpc.convert import sampling_to_proto
from rpc.interceptors import server_interceptors
from rpc.internal.v1 import worker_pb2, worker_pb2_grpc
from tests.prefill_worker.in_place_engine import InPlaceEngine

LAYOUT = KVLayout(num_layers=2, latent_dim=16, rope_dim=4, page_size=16, dtype="float32")
TOKEN = "stream-test-token"


class GatedEngine(InPlaceEngine):
    """Answers each prompt with its first token id once `gate` is set; a prompt whose should_stop says so (asked
    after the gate, as the engine asks between chunks) gets None and is listed in `stopped`."""

    def __init__(self) -> None:
        super().__init__(LAYOUT)
        self.gate = threading.Event()
        self.started: list[str] = []
        self.stopped: list[str] = []

    def prefill(self, jobs: list[PrefillJob],
                should_stop: Callable[[str], bool] | None = None) -> list[PrefillResult | None]:
        self.started.extend(job.request_id for job in jobs)
        assert self.gate.wait(60)
        results: list[PrefillResult | None] = []
        for job in jobs:
            if should_stop is not None and should_stop(job.request_id):
                self.stopped.append(job.request_id)
                results.append(None)
            else:
                results.append(PrefillResult(job.request_id, job.prompt_ids[0], None, len(job.prompt_ids), 0.0))
        return results


@dataclass
class StreamWorker:
    """The running server: its address, service, servicer and fake engine, and the decode side's receiver."""

    address: str
    server: grpc.aio.Server
    service: PrefillService
    servicer: PrefillServicer
    engine: GatedEngine
    receiver: ShmReceiver
    allocator: PageAllocator
    leases: LeaseTable
    stopped: bool = False

    def request(self, request_id: str, prompt: list[int], **sampling: Any) -> worker_pb2.PrefillRequest:
        """A PrefillRequest into freshly reserved pages (reserved as Reserve would)."""
        pages = self.allocator.allocate(LAYOUT.pages_for_tokens(len(prompt)))
        destination = self.receiver.expect(self.leases.grant(request_id, pages, 60), len(prompt))
        params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True, **sampling)
        return worker_pb2.PrefillRequest(request_id=request_id, token_ids=prompt, sampling=sampling_to_proto(params),
                                         destination=destination.to_proto())


async def start_worker(pool: SharedPagePool, batch_tokens: int = 2048, token: str | None = TOKEN,
                       port: int = 0) -> StreamWorker:
    engine = GatedEngine()
    engine.gate.set()
    service = PrefillService(PrefillWorkerConfig.build(batch_tokens=batch_tokens), engine_factory=lambda: engine)
    await service.start()
    servicer = PrefillServicer(service)
    server = grpc.aio.server(interceptors=list(server_interceptors(token)))
    worker_pb2_grpc.add_PrefillServiceServicer_to_server(servicer, server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return StreamWorker(f"127.0.0.1:{bound}", server, service, servicer, engine, ShmReceiver([pool]),
                        PageAllocator(64), LeaseTable(grace_s=0))


async def stop_worker(worker: StreamWorker) -> None:
    """Stops the server at once (its calls end as when the process dies), then releases and stops the engine.
    Idempotent, so tests call it again in their `finally`."""
    if worker.stopped:
        return
    worker.stopped = True
    await worker.server.stop(None)
    worker.engine.gate.set()
    await worker.service.stop()


@pytest.fixture
def shm_pool() -> Any:
    with SharedPagePool.create(LAYOUT, 64, num_slots=32) as pool:
        yield pool


@pytest.fixture
async def stream_worker(shm_pool: SharedPagePool) -> AsyncIterator[StreamWorker]:
    worker = await start_worker(shm_pool)
    yield worker
    await stop_worker(worker)
