"""The two sides of the first-token path in one process, for benchmarks/profile_first_token.py: the real
handlers, services and messages, with gRPC's transport and the model forward taken out."""
from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections import namedtuple
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from engine.kv_cache import PageAllocator
from engine.llm_engine import PrefillResult
from gateway.config import GatewayConfig
from gateway.model_info import ModelFacts
from gateway.service import GatewayService
from gateway.servicer import GatewayServicer, add_gateway_to_server
from gateway.standing_leases import Spare
from gateway.tokenizer import TextTokenizer
from gateway.transport_choice import Placement
from gateway.wire import parse_generate_request_bytes
from gateway.workers import WorkerPool
from kvtransfer.layout import KVLayout
from kvtransfer.leases import LeaseTable
from kvtransfer.shm_pool import SharedPagePool
from kvtransfer.shm_receiver import ShmReceiver
from prefill_worker.config import PrefillWorkerConfig
from prefill_worker.service import PrefillService, _build_engine
from prefill_worker.servicer import PrefillServicer
from rpc.convert import sampling_fields, sampling_to_proto
from rpc.interceptors import MalformedRequestInterceptor, server_interceptors
from rpc.internal.v1 import kv_pb2, worker_pb2
from rpc.logging_setup import configure_logging
from rpc.v1 import gateway_pb2
from engine.sampling_params import SamplingParams
from kvtransfer.destination import Destination

Piece = Callable[[], Awaitable[int]]
_CallDetails = namedtuple("_CallDetails", "method invocation_metadata")


def quiet_info_logging() -> None:
    """INFO lines formatted as a service formats them (role, request id), written to /dev/null."""
    configure_logging("bench")
    for handler in logging.getLogger().handlers:
        handler.setStream(open(os.devnull, "w"))  # noqa: SIM115 - lives as long as the process


class FakeContext:
    """The grpc.aio.ServicerContext calls our handlers make."""

    def __init__(self, metadata: tuple[tuple[str, str], ...] = ()) -> None:
        self._metadata = metadata
        self.callbacks: list[Callable[[Any], None]] = []

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def time_remaining(self) -> float | None:
        return None

    def add_done_callback(self, callback: Callable[[Any], None]) -> None:
        self.callbacks.append(callback)

    def done(self) -> None:
        for callback in self.callbacks:
            callback(self)

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()) -> None:
        raise RuntimeError(f"aborted: {code.name} {details}")


async def wrapped_handler(server_method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """The handler as a server with MalformedRequestInterceptor serves it."""
    async def continuation(_: Any) -> grpc.RpcMethodHandler:
        return handler

    return await MalformedRequestInterceptor().intercept_service(continuation, _CallDetails(server_method, ()))


def interceptor_pieces() -> dict[str, Piece]:
    """Per call: the chain every pdserve server installs (rpc.interceptors.server_interceptors), as gRPC runs
    it for each RPC, without and with an internal token; and the malformed-request wrapper's own call."""
    handler = grpc.unary_unary_rpc_method_handler(_echo, lambda data: data, lambda data: data)
    details = _CallDetails("/pdserve.internal.v1.PrefillService/Prefill", (("authorization", "Bearer t0ken"),))

    def chain(tokens: tuple[str, ...]) -> Piece:
        interceptors = server_interceptors(*tokens)

        async def call(index: int, call_details: Any) -> grpc.RpcMethodHandler:
            if index == len(interceptors):
                return handler
            return await interceptors[index].intercept_service(lambda d: call(index + 1, d), call_details)

        async def once() -> int:
            start = time.thread_time_ns()
            await call(0, details)
            return time.thread_time_ns() - start

        return once

    wrapped_box: dict[str, grpc.RpcMethodHandler] = {}

    async def wrapped_call() -> int:
        if "h" not in wrapped_box:
            wrapped_box["h"] = await wrapped_handler(details.method, handler)
        context = FakeContext()
        start = time.thread_time_ns()
        await wrapped_box["h"].unary_unary(b"x", context)
        return time.thread_time_ns() - start

    async def raw_call() -> int:
        context = FakeContext()
        start = time.thread_time_ns()
        await _echo(b"x", context)
        return time.thread_time_ns() - start

    return {"rpc: interceptor chain per call, no token": chain(()),
            "rpc: interceptor chain per call, internal token": chain(("t0ken",)),
            "rpc: a unary handler, bare": raw_call,
            "rpc: a unary handler, malformed-request wrapped": wrapped_call}


async def _echo(request: Any, context: Any) -> Any:
    return request


class _InstantEngine:
    """The real engine's config, cache shape and prompt checks; prefill answers at once (no forward)."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.config, self.cache_shape = engine.config, engine.cache_shape
        self.validate_prompt = engine.validate_prompt

    def prefill(self, jobs: list[Any], should_stop: Any = None) -> list[PrefillResult]:
        for job in jobs:  # as the engine asks before its first chunk
            if should_stop is not None and should_stop(job.request_id):
                return [None] * len(jobs)  # type: ignore[list-item]
        return [PrefillResult(job.request_id, 11, None, len(job.prompt_ids), 0.0) for job in jobs]

    def close(self) -> None:
        self._engine.close() if hasattr(self._engine, "close") else None


class PrefillSide:
    """A PrefillService over the instant engine, the decode side's shm pool and reservations."""

    def __init__(self, service: PrefillService, pool: SharedPagePool) -> None:
        self.service = service
        self.layout: KVLayout = service.layout
        self._pool = pool
        self._allocator, self._leases = PageAllocator(pool.num_pages), LeaseTable(grace_s=0)
        self._receiver = ShmReceiver([pool])
        self.servicer = PrefillServicer(service)
        self.engine_ns = 0
        inner = service._engine._work

        def timed_work(engine: Any) -> bool:
            start = time.thread_time_ns()
            try:
                return inner(engine)
            finally:
                self.engine_ns += time.thread_time_ns() - start

        service._engine._work = timed_work  # the engine thread looks it up on every pass

    @classmethod
    async def start(cls, model_dir: str) -> PrefillSide:
        quiet_info_logging()
        config = PrefillWorkerConfig.build(model_dir=model_dir, device="cpu")
        service = PrefillService(config, engine_factory=lambda: _InstantEngine(_build_engine(config)))
        await service.start()
        pool = SharedPagePool.create(service.layout, 256, num_slots=8, owner_tag=f"ftbench{os.getpid()}")
        return cls(service, pool)

    async def close(self) -> None:
        await self.service.stop()
        self._pool.close()
        self._pool.unlink()

    def reserve(self, request_id: str, tokens: int) -> Destination:
        pages = self._allocator.allocate(self.layout.pages_for_tokens(tokens))
        return self._receiver.expect(self._leases.grant(request_id, pages, 60), tokens)

    def release(self, destination: Destination) -> None:
        self._receiver.cancel(destination.request_id)
        self._leases.release(destination.lease_id)
        self._allocator.free(list(destination.page_ids))

    def request(self, prompt: list[int], destination: Destination) -> worker_pb2.PrefillRequest:
        sampling = sampling_to_proto(SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True))
        return worker_pb2.PrefillRequest(request_id=destination.request_id, token_ids=prompt, sampling=sampling,
                                         destination=destination.to_proto())

    async def prefill_once(self, handler: grpc.RpcMethodHandler, prompt: list[int],
                           clock: Callable[[], int]) -> tuple[int, int]:
        """(CPU ns of the handler up to its reply by `clock`, engine thread ns of it); the record is
        written and the lease released after, untimed."""
        destination = self.reserve(f"p-{uuid.uuid4().hex[:12]}", len(prompt))
        data = self.request(prompt, destination).SerializeToString()
        context, engine_before = FakeContext(), self.engine_ns
        start = clock()
        request = handler.request_deserializer(data)
        handler.response_serializer(await handler.unary_unary(request, context))
        spent = clock() - start
        engine_ns = self.engine_ns - engine_before
        context.done()
        while self.service._jobs:
            await asyncio.sleep(0)
        self.release(destination)
        return spent, engine_ns

    def pieces(self, prompt: list[int]) -> dict[str, Piece]:
        standing = self.reserve("p-fixed", len(prompt))
        message = self.request(prompt, standing)
        data = message.SerializeToString()
        service, handler_box = self.service, {}
        params = SamplingParams(**sampling_fields(message.sampling))
        response = worker_pb2.PrefillResponse(first_token=11, num_prompt_tokens=len(prompt),
                                              timing=worker_pb2.PrefillTiming(queue_ms=0.1, prefill_ms=30.0))

        async def handler() -> grpc.RpcMethodHandler:
            if "h" not in handler_box:
                raw = grpc.unary_unary_rpc_method_handler(
                    self.servicer.Prefill, worker_pb2.PrefillRequest.FromString,
                    worker_pb2.PrefillResponse.SerializeToString)
                handler_box["h"] = await wrapped_handler("/pdserve.internal.v1.PrefillService/Prefill", raw)
            return handler_box["h"]

        async def whole(clock: Callable[[], int]) -> int:
            return (await self.prefill_once(await handler(), prompt, clock))[0]

        async def engine_part() -> int:
            return (await self.prefill_once(await handler(), prompt, time.thread_time_ns))[1]

        def sync(fn: Callable[[], Any]) -> Piece:
            async def once() -> int:
                start = time.thread_time_ns()
                fn()
                return time.thread_time_ns() - start
            return once

        return {
            "prefill: PrefillRequest.FromString": sync(lambda: worker_pb2.PrefillRequest.FromString(data)),
            "prefill: sampling -> SamplingParams": sync(lambda: SamplingParams(**sampling_fields(message.sampling))),
            "prefill: KVDestination -> Destination": sync(lambda: Destination.from_proto(message.destination)),
            "prefill: PrefillService._check": sync(lambda: service._check("p-fixed", prompt, params, standing)),
            "prefill: PrefillResponse build + serialise": sync(lambda: worker_pb2.PrefillResponse(
                first_token=11, num_prompt_tokens=len(prompt), timing=response.timing).SerializeToString()),
            "prefill: handler to reply, loop thread (thread CPU)": lambda: whole(time.thread_time_ns),
            "prefill: handler to reply, both threads (process CPU)": lambda: whole(time.process_time_ns),
            "prefill: engine thread _work, forward excluded": engine_part,
        }


class _Stubs:
    """Worker stubs that answer at once: they serialise the request and parse the reply as gRPC does."""

    def __init__(self, destination: kv_pb2.KVDestination, prompt_len: int) -> None:
        self._reserve = worker_pb2.ReserveResponse(destination=destination).SerializeToString()
        self._prefill = worker_pb2.PrefillResponse(
            first_token=11, num_prompt_tokens=prompt_len,
            timing=worker_pb2.PrefillTiming(queue_ms=0.1, prefill_ms=30.0)).SerializeToString()
        self._decode = worker_pb2.DecodeResponse(token_ids=[12, 13, 14], finished=True, finish_reason="length",
                                                 decode_steps=3).SerializeToString()

    async def Reserve(self, request: Any, **_: Any) -> worker_pb2.ReserveResponse:  # noqa: N802
        request.SerializeToString()
        return worker_pb2.ReserveResponse.FromString(self._reserve)

    async def Prefill(self, request: Any, **_: Any) -> worker_pb2.PrefillResponse:  # noqa: N802
        request.SerializeToString()
        return worker_pb2.PrefillResponse.FromString(self._prefill)

    async def Release(self, request: Any, **_: Any) -> worker_pb2.ReleaseResponse:  # noqa: N802
        return worker_pb2.ReleaseResponse()

    def Decode(self, request: Any, **_: Any) -> Any:  # noqa: N802
        request.SerializeToString()
        return _DecodeStream(self._decode)


class _DecodeStream:
    def __init__(self, data: bytes) -> None:
        self._data = data

    async def _items(self) -> AsyncIterator[worker_pb2.DecodeResponse]:
        yield worker_pb2.DecodeResponse.FromString(self._data)

    def __aiter__(self) -> AsyncIterator[worker_pb2.DecodeResponse]:
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
            worker.state.healthy, worker.state.placement = True, Placement("node", device="cpu")
            worker.stub = stubs  # type: ignore[assignment]
        for worker in pool.decode:
            worker.state.healthy, worker.state.placement = True, Placement("node", kv_pool="shm")
            worker.state.free_pages, worker.state.total_pages, worker.state.page_size = 4000, 4096, layout.page_size
            worker.stub = stubs  # type: ignore[assignment]
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

        def sync(fn: Callable[[], Any]) -> Piece:
            async def once() -> int:
                start = time.thread_time_ns()
                fn()
                return time.thread_time_ns() - start
            return once

        fixed = data()
        spare = self._destination.to_proto()
        return {
            "gateway: GenerateRequest bytes -> WireGenerateRequest": sync(lambda: parse_generate_request_bytes(fixed)),
            "gateway: standing lease take()": take,
            "gateway: sampling_to_proto": sync(lambda: sampling_to_proto(params)),
            "gateway: PrefillRequest build + serialise": sync(lambda: worker_pb2.PrefillRequest(
                request_id="x", token_ids=prompt, sampling=sampling_to_proto(params),
                destination=spare).SerializeToString()),
            "gateway: first GenerateResponse build + serialise": sync(lambda: gateway_pb2.GenerateResponse(
                request_id="x", chunk=gateway_pb2.Chunk(token_ids=[11], text="ab", logprobs=[])).SerializeToString()),
            "gateway: handler to first message, standing lease": lambda: whole(True),
            "gateway: handler to first message, Reserve": lambda: whole(False),
        }


class _HandlerCatcher:
    """Takes the generic handler add_gateway_to_server registers and keeps its Generate handler."""

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        details = _CallDetails("/pdserve.v1.GatewayService/Generate", ())
        self.generate = handlers[0].service(details)
