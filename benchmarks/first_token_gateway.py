"""The gateway side of benchmarks/profile_first_token.py: the real Generate handler and GatewayService over a
real WorkerPool (one prefill, one decode worker, shm, polled) whose stubs answer at once."""
from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from benchmarks.first_token_fixtures import CallDetails, FakeContext, Piece, sync_piece, wrapped_handler
from engine.sampling_params import SamplingParams
from gateway.config import GatewayConfig
from gateway.model_info import ModelFacts
from gateway.service import GatewayService
from gateway.servicer import GatewayServicer, add_gateway_to_server
from gateway.standing_leases import Spare
from gateway.tokenizer import TextTokenizer
from gateway.transport_choice import Placement
from gateway.wire import parse_generate_request_bytes
from gateway.workers import WorkerPool
from kvtransfer.destination import Destination
from kvtransfer.layout import KVLayout
from rpc.convert import sampling_to_proto
from rpc.internal.v1 import kv_pb2, worker_pb2
from rpc.v1 import gateway_pb2


class _Stubs:
    """Worker stubs and streams that answer at once: they serialise the request and parse the reply as gRPC does."""

    def __init__(self, destination: kv_pb2.KVDestination, prompt_len: int) -> None:
        self._reserve = worker_pb2.ReserveResponse(destination=destination).SerializeToString()
        self._prefill = worker_pb2.PrefillResponse(
            first_token=11, num_prompt_tokens=prompt_len,
            timing=worker_pb2.PrefillTiming(queue_ms=0.1, prefill_ms=30.0)).SerializeToString()
        self._decode = worker_pb2.DecodeStreamUpdate(token_ids=[12, 13, 14], finished=True, finish_reason="length",
                                                     decode_steps=3).SerializeToString()

    async def Reserve(self, request: Any, **_: Any) -> worker_pb2.ReserveResponse:  # noqa: N802
        request.SerializeToString()
        return worker_pb2.ReserveResponse.FromString(self._reserve)

    async def Release(self, request: Any, **_: Any) -> worker_pb2.ReleaseResponse:  # noqa: N802
        return worker_pb2.ReleaseResponse()

    async def close(self) -> None:
        """(a worker stream's: nothing to end)"""

    def hang_signal(self) -> asyncio.Future[str]:
        """A decode stream's hang signal (gateway/liveness.py): these workers never hang."""
        return asyncio.get_running_loop().create_future()

    def drop_hang_signal(self, waiter: asyncio.Future[str]) -> None:
        """(a decode stream's: nothing kept)"""

    def submit(self, request: Any, timeout: float | None, trace_id: str = "") -> Any:
        """A worker stream's submit: a prefill's answer (a future) or a decode's chunks."""
        request.SerializeToString()
        if isinstance(request, worker_pb2.DecodeRequest):
            return _DecodeStream(self._decode)
        answer = asyncio.get_running_loop().create_future()
        answer.set_result(worker_pb2.PrefillResponse.FromString(self._prefill))
        return answer


class _DecodeStream:
    def __init__(self, data: bytes) -> None:
        self._data = data

    async def _items(self) -> AsyncIterator[worker_pb2.DecodeStreamUpdate]:
        yield worker_pb2.DecodeStreamUpdate.FromString(self._data)

    def __aiter__(self) -> AsyncIterator[worker_pb2.DecodeStreamUpdate]:
        return self._items()

    def cancel(self) -> None:
        pass


class GatewaySide:
    """A GatewayService over a real WorkerPool (one prefill, one decode worker, shm, polled) with instant stubs."""

    def __init__(self, service: GatewayService, destination: Destination) -> None:
        self.service, self.pool = service, service.pool
        self._destination = destination
        self.servicer = GatewayServicer(service)

    @classmethod
    async def start(cls, model_dir: str, layout: KVLayout, standing_tokens: int = 256) -> GatewaySide:
        config = GatewayConfig(model_dir=model_dir, prefill=("127.0.0.1:9",), decode=("127.0.0.1:9",),
                               standing_lease_tokens=standing_tokens)
        pool = WorkerPool(config)
        pages = tuple(range(layout.pages_for_tokens(standing_tokens)))
        destination = Destination(
            transport=1, layout_hash=layout.hash, request_id="standing.0", lease_id="a" * 32, page_ids=pages,
            targets=("pdserve-pool-0",), lease_deadline_unix_ms=int(time.time() * 1000) + 3_600_000,
            num_tokens=standing_tokens, pool_num_pages=4096, completion_slot=3, completion_sequence=5)
        stubs = _Stubs(destination.to_proto(), 128)
        for worker in pool.prefill:
            worker.load.healthy, worker.load.placement = True, Placement("node", device="cpu")
            worker.stub = worker.stream = stubs  # type: ignore[assignment]
        for worker in pool.decode:
            worker.load.healthy, worker.load.placement = True, Placement("node", kv_pool="shm")
            worker.load.free_pages, worker.load.total_pages, worker.load.page_size = 4000, 4096, layout.page_size
            worker.stub = worker.stream = stubs  # type: ignore[assignment]
        pool.healthy = True
        pool.polled.set()
        service = GatewayService(config, ModelFacts.from_dir(model_dir), TextTokenizer.from_model_dir(model_dir), pool)
        return cls(service, destination)

    async def close(self) -> None:
        await self.service.shutdown(5.0)
        await self.pool.close()

    def offer_spare(self) -> None:
        assert self.pool.standing is not None
        self.pool.standing._spares[0] = Spare(self.pool.decode[0], self._destination.to_proto())

    async def generate_once(self, handler: grpc.RpcMethodHandler, data: bytes, standing: bool,
                            clock: Callable[[], int] = time.thread_time_ns) -> int:
        """CPU ns from the request's bytes to the first message's bytes; the rest of the stream untimed."""
        if standing:
            self.offer_spare()
        elif self.pool.standing is not None:
            self.pool.standing._spares.clear()
        context = FakeContext()
        start = clock()
        stream = handler.unary_stream(handler.request_deserializer(data), context).__aiter__()
        handler.response_serializer(await stream.__anext__())
        spent = clock() - start
        async for _ in stream:
            pass
        context.done()
        while self.service._runs:
            await asyncio.sleep(0)
        return spent

    def pieces(self, prompt: list[int]) -> dict[str, Piece]:
        request = gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=prompt), max_tokens=4,
                                              sampling=gateway_pb2.SamplingParams(temperature=0.0), ignore_eos=True)
        handler_box: dict[str, grpc.RpcMethodHandler] = {}
        params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)

        async def handler() -> grpc.RpcMethodHandler:
            if "h" not in handler_box:
                server = _HandlerCatcher()
                add_gateway_to_server(self.servicer, server)  # type: ignore[arg-type]
                handler_box["h"] = await wrapped_handler("/pdserve.v1.GatewayService/Generate", server.generate)
            return handler_box["h"]

        def data() -> bytes:
            request.request_id = f"g-{uuid.uuid4().hex[:12]}"
            return request.SerializeToString()

        async def whole(standing: bool) -> int:
            return await self.generate_once(await handler(), data(), standing)

        async def take() -> int:
            self.offer_spare()
            start = time.thread_time_ns()
            self.pool.take_standing(len(prompt))
            return time.thread_time_ns() - start

        fixed = data()
        spare = self._destination.to_proto()
        return {
            "gateway: GenerateRequest bytes -> WireGenerateRequest": sync_piece(lambda: parse_generate_request_bytes(fixed)),
            "gateway: standing lease take()": take,
            "gateway: sampling_to_proto": sync_piece(lambda: sampling_to_proto(params)),
            "gateway: PrefillRequest build + serialise": sync_piece(lambda: worker_pb2.PrefillRequest(
                request_id="x", token_ids=prompt, sampling=sampling_to_proto(params),
                destination=spare).SerializeToString()),
            "gateway: first GenerateResponse build + serialise": sync_piece(lambda: gateway_pb2.GenerateResponse(
                request_id="x", chunk=gateway_pb2.Chunk(token_ids=[11], text="ab", logprobs=[])).SerializeToString()),
            "gateway: handler to first message, standing lease": lambda: whole(True),
            "gateway: handler to first message, Reserve": lambda: whole(False),
        }


class _HandlerCatcher:
    """Takes the generic handler add_gateway_to_server registers and keeps its Generate handler."""

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        details = CallDetails("/pdserve.v1.GatewayService/Generate", ())
        self.generate = handlers[0].service(details)
