"""A decode worker's gRPC server in the test's process, for the DecodeStream tests (worker and gateway side):
the real DecodeServicer over a scripted DecodeService whose requests stream from a real Streams, into which
the test delivers engine step outputs by hand (as the engine port does), so every delivery is the test's."""
from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from decode_worker.servicer import DecodeServicer
from decode_worker.streams import Sink, Streams
from engine.runtime.outputs import StepOutput
from engine.sampling_params import SamplingParams
from rpc.convert import sampling_to_proto
from rpc.interceptors import server_interceptors
from rpc.internal.v1 import worker_pb2, worker_pb2_grpc
from rpc.status import NotFound

TOKEN = "decode-stream-test-token"
LEASE = "lease-ok"
FIRST = 7  # every request's first token (from "prefill"), re-emitted by its first step output


@dataclass
class ScriptedService:
    """What the servicer calls (run_decode, release_soon), recording what it is asked to abort and release.
    run_decode refuses any lease but LEASE (NOT_FOUND, as an unknown lease), else streams from `streams`."""

    aborted: list[str] = field(default_factory=list)
    released: list[str] = field(default_factory=list)
    streams: Streams = field(init=False)

    def __post_init__(self) -> None:
        self.streams = Streams(self.aborted.append)

    async def run_decode(self, request_id: str, lease_id: str, prompt_ids: list[int], first_token: int,
                         params: SamplingParams, stream_interval: int, sink: Sink, local: bool = False) -> None:
        if lease_id != LEASE:
            raise NotFound(f"no lease {lease_id!r} for request {request_id}")
        self.streams.open(request_id, max(1, stream_interval), sink)
        await self.streams.run(request_id)

    def release_soon(self, request_id: str) -> None:
        self.released.append(request_id)

    def open(self) -> set[str]:
        """The requests streaming now (their first step output may be delivered)."""
        return set(self.streams.open_ids())

    def step(self, request_ids: list[str], token: int, finished: tuple[str, ...] = ()) -> None:
        """One engine step's outputs, delivered: `token` for each request (FIRST for a first step, which the
        stream drops as prefill's token); those in `finished` finish with "length"."""
        self.streams.deliver([StepOutput(request_id, [token], request_id in finished,
                                         "length" if request_id in finished else None) for request_id in request_ids])


def decode_request(request_id: str, lease_id: str = LEASE) -> worker_pb2.DecodeRequest:
    params = SamplingParams(max_new_tokens=64, temperature=0.0, ignore_eos=True)
    return worker_pb2.DecodeRequest(request_id=request_id, lease_id=lease_id, token_ids=[5, 6, 7], first_token=FIRST,
                                    sampling=sampling_to_proto(params))


@dataclass
class StreamWorker:
    address: str
    server: grpc.aio.Server
    service: ScriptedService
    servicer: DecodeServicer
    stopped: bool = False


async def start_worker(token: str | None = TOKEN, port: int = 0) -> StreamWorker:
    service = ScriptedService()
    servicer = DecodeServicer(service)  # type: ignore[arg-type]
    server = grpc.aio.server(interceptors=list(server_interceptors(token)))
    worker_pb2_grpc.add_DecodeServiceServicer_to_server(servicer, server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return StreamWorker(f"127.0.0.1:{bound}", server, service, servicer)


async def stop_worker(worker: StreamWorker) -> None:
    """Stops the server at once (its calls end as when the process dies). Idempotent."""
    if not worker.stopped:
        worker.stopped = True
        await worker.server.stop(None)


@contextlib.asynccontextmanager
async def serving(token: str | None = TOKEN) -> AsyncIterator[StreamWorker]:
    worker = await start_worker(token)
    try:
        yield worker
    finally:
        await stop_worker(worker)
