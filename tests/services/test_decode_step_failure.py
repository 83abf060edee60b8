"""A decode engine step that raises, inside a running DecodeService behind an in-process gRPC server: the
client's Decode stream ends with INTERNAL naming the failure, the request's pages (and state slot) go back
to the pool, and the worker decodes the next request normally."""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest

from decode_worker.config import DecodeWorkerConfig
from decode_worker.server import _Receivers
from decode_worker.service import DecodeService
from decode_worker.servicer import DecodeServicer
from kvtransfer.destination import Destination
from rpc.convert import sampling_to_proto
from rpc.internal.v1 import kv_pb2, worker_pb2, worker_pb2_grpc
from tests.decode_worker.thread_port import thread_port
from tests.services.decode_hooks import NextDecodeForward, mark_kv_complete
from tests.services.helpers import decode_once, eventually, greedy

PROMPT = [5, 9, 13, 17, 21, 25, 29, 33, 37, 41]
MAX_TOKENS = 6
pytestmark = pytest.mark.slow  # an engine start and two decodes: ~20 s on the shared machine


def _inject_failure() -> None:
    raise RuntimeError("injected decode forward failure")


@pytest.fixture
async def served(service_model) -> AsyncIterator[tuple[DecodeService, worker_pb2_grpc.DecodeServiceStub, NextDecodeForward]]:
    receivers = _Receivers()
    config = DecodeWorkerConfig.build(model_dir=str(service_model), draft_model_dir="", attention_backend="torch",
                                      kv_memory_bytes=256 * 1024, page_size=16, num_threads=1)
    service = DecodeService(config, receivers, port_factory=thread_port(config))  # reached into: an engine thread
    await service.start()
    failure = NextDecodeForward(service.engine.leader.execute, _inject_failure)
    service.engine.leader.execute = failure  # instance attribute: only this engine's forwards are wrapped
    receivers.push.advertise(["127.0.0.1:1"] * len(receivers.pools))  # no pushes here; expect() needs an address
    server = grpc.aio.server()
    worker_pb2_grpc.add_DecodeServiceServicer_to_server(DecodeServicer(service), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield service, worker_pb2_grpc.DecodeServiceStub(channel), failure
    finally:
        await server.stop(grace=None)
        await service.stop()
        receivers.close()


async def _decode(service: DecodeService, stub: worker_pb2_grpc.DecodeServiceStub, request_id: str) -> list[int]:
    """Reserve over gRPC, mark the (already zeroed) pages complete as a prefill worker would, then decode over a
    DecodeStream."""
    reply = await stub.Reserve(worker_pb2.ReserveRequest(request_id=request_id, num_prompt_tokens=len(PROMPT),
                                                         max_new_tokens=MAX_TOKENS, transport=kv_pb2.TRANSPORT_SHM),
                               timeout=30)
    mark_kv_complete(service.engine, Destination.from_proto(reply.destination))
    request = worker_pb2.DecodeRequest(request_id=request_id, lease_id=reply.destination.lease_id, token_ids=PROMPT,
                                       first_token=7, sampling=sampling_to_proto(greedy(MAX_TOKENS)))
    return await decode_once(stub, request, 120)


async def _engine_settles(service: Any, probe: Callable[[Any], Any], expected: Any, timeout: float = 120.0) -> None:
    """Polls probe on the engine thread until it returns expected (the aborted requests leave the engine at its
    next step, which a loaded machine may delay); fails loudly with the last value after timeout seconds."""
    deadline = time.monotonic() + timeout
    while (seen := await service._port.engine_thread.call(probe)) != expected:
        assert time.monotonic() < deadline, f"engine did not settle in {timeout} s: {seen} != {expected}"
        await asyncio.sleep(0.01)


def _state_slots_free(engine: Any) -> int:
    return engine.state_pool.num_free if engine.state_pool is not None else 0


async def test_failed_engine_step_ends_the_stream_frees_pages_and_keeps_serving(served):
    """The injected forward failure reaches the client as INTERNAL naming the engine step and the cause; the
    engine then holds no request, every page and state slot is free again, and the next request decodes
    all its tokens."""
    service, stub, failure = served
    free_pages = await service._port.engine_thread.call(lambda engine: engine.num_free_pages)
    free_slots = await service._port.engine_thread.call(_state_slots_free)
    failure.armed.set()
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _decode(service, stub, "doomed")
    assert failure.fired.is_set()
    assert caught.value.code() == grpc.StatusCode.INTERNAL
    assert "engine step failed" in caught.value.details() and "injected decode forward failure" in caught.value.details()

    def idle(engine: Any) -> tuple[bool, int, int]:
        return engine.has_work(), engine.num_free_pages, _state_slots_free(engine)

    await eventually(lambda: service.load.free_pages == free_pages and service.load.leases == 0, "pages freed")
    await _engine_settles(service, idle, (False, free_pages, free_slots))
    tokens = await _decode(service, stub, "next")
    assert len(tokens) == MAX_TOKENS - 1  # the first token came from "prefill"; Decode streams the rest
    await _engine_settles(service, idle, (False, free_pages, free_slots))
