"""The public API around the happy path, on the shared deployment: reflection, validation, abort and
cancellation (pages come back), deadlines, health and model info."""
from __future__ import annotations

import asyncio
import socket
import time

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status
import pytest
from google.protobuf import descriptor_pool, message_factory
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from gateway.client import build_request, generate
from gateway.config import GatewayConfig
from gateway.server import serve as serve_gateway
from rpc.v1 import gateway_pb2
from tests.services.conftest import worker_address
from tests.services.helpers import (at_rest, decode_load, gateway_stub, greedy, idle_free_pages, prefill_load,
                                   token_prompts, unspared_free_pages, wait_for_free_pages)

EXPECTED_HEALTH = {"dead": health_pb2.HealthCheckResponse.NOT_SERVING, "live": health_pb2.HealthCheckResponse.SERVING}
GOOD = build_request([5, 6, 7, 8], max_tokens=4, temperature=0.0, ignore_eos=True)


def test_client_built_only_from_reflection_calls_generate(cluster, llm):
    """Service list, request and response types all come from server reflection (no generated stubs)."""
    with grpc.insecure_channel(cluster.gateway_address) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        services = set(database.get_services())
        assert {"pdserve.v1.GatewayService", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= services
        pool = descriptor_pool.DescriptorPool(database)
        method = pool.FindServiceByName("pdserve.v1.GatewayService").methods_by_name["Generate"]
        request_type = message_factory.GetMessageClass(method.input_type)
        response_type = message_factory.GetMessageClass(method.output_type)
        request = request_type(max_tokens=5, ignore_eos=True)
        request.token_ids.ids.extend([9, 10, 11])
        request.sampling.temperature = 0.0
        call = channel.unary_stream("/pdserve.v1.GatewayService/Generate", request_serializer=request_type.SerializeToString,
                                    response_deserializer=response_type.FromString)
        responses = list(call(request, timeout=120))
    tokens = [t for r in responses if r.WhichOneof("kind") == "chunk" for t in r.chunk.token_ids]
    assert responses[-1].WhichOneof("kind") == "complete"
    assert tokens == llm.generate([[9, 10, 11]], greedy(5))[0]


def _raw_both_inputs() -> bytes:
    return (gateway_pb2.GenerateRequest(text="hello").SerializeToString()
            + gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=[5]), max_tokens=2).SerializeToString())


BAD = [
    (gateway_pb2.GenerateRequest(text=""), "input.text"),
    (gateway_pb2.GenerateRequest(max_tokens=3), "input"),
    (None, "input"),  # both text and token_ids on the wire
    (build_request([5] * 4096), "input"),
    (build_request([5] * 4000, max_tokens=200), "max_tokens"),
    (build_request([5, 320, 6]), "input.token_ids[1]"),
    (build_request([5], max_tokens=0), "max_tokens"),
    (build_request([5], max_tokens=-2), "max_tokens"),
    (build_request([5], temperature=-0.5), "sampling.temperature"),
    (build_request([5], top_p=1.5), "sampling.top_p"),
    (build_request([5], top_logprobs=50), "top_logprobs"),
]


def _bad_request(error: grpc.aio.AioRpcError) -> error_details_pb2.BadRequest:
    """The google.rpc.BadRequest packed in the status details (grpc-status-details-bin trailer)."""
    status = rpc_status.from_call(error)
    assert status is not None, "no google.rpc.Status in the trailing metadata"
    assert status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and status.message == error.details()
    found = [detail for detail in status.details if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR)]
    assert len(found) == 1, status.details
    bad = error_details_pb2.BadRequest()
    found[0].Unpack(bad)
    return bad


async def test_bad_requests_get_invalid_argument_naming_the_field(cluster):
    """Each bad request fails with INVALID_ARGUMENT whose details start with the field and whose
    google.rpc.BadRequest detail names the same field; then a good one works."""
    async with grpc.aio.insecure_channel(cluster.gateway_address) as channel:
        raw = channel.unary_stream("/pdserve.v1.GatewayService/Generate", request_serializer=lambda data: data,
                                   response_deserializer=gateway_pb2.GenerateResponse.FromString)
        stub_generate = channel.unary_stream("/pdserve.v1.GatewayService/Generate",
                                             request_serializer=gateway_pb2.GenerateRequest.SerializeToString,
                                             response_deserializer=gateway_pb2.GenerateResponse.FromString)
        for request, field in BAD:
            call = raw(_raw_both_inputs(), timeout=30) if request is None else stub_generate(request, timeout=30)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                async for _ in call:
                    pass
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, caught.value.details())
            assert caught.value.details().startswith(field + ":"), (field, caught.value.details())
            assert [v.field for v in _bad_request(caught.value).field_violations] == [field], caught.value.details()
        responses = [r async for r in stub_generate(GOOD, timeout=60)]
    assert responses[-1].complete.finish_reason == gateway_pb2.Complete.FINISH_REASON_LENGTH


async def test_client_cancel_mid_stream_frees_decode_pages(cluster):
    """Cancelling a Generate call while it streams aborts it on the decode worker: free pages return
    to the idle baseline and nothing is left running."""
    decode = worker_address(cluster, "decode-0")
    baseline = await idle_free_pages(decode)
    async with gateway_stub(cluster.gateway_address) as stub:
        call = stub.Generate(build_request(token_prompts((300,))[0], max_tokens=2000, temperature=0.0, ignore_eos=True),
                             timeout=120)
        received = 0
        async for response in call:
            received += len(response.chunk.token_ids)
            if received >= 5:
                break
        during = unspared_free_pages(await decode_load(decode))
        call.cancel()
    assert during < baseline  # the request held pages while streaming
    load = await wait_for_free_pages(decode, baseline)
    assert at_rest(load, baseline), load


async def test_abort_rpc_ends_the_stream_with_abort(cluster):
    """Abort(request_id) from another call ends the stream with Complete(ABORT) and frees the pages."""
    decode = worker_address(cluster, "decode-0")
    baseline = await idle_free_pages(decode)
    async with gateway_stub(cluster.gateway_address) as stub:
        request = build_request(token_prompts((200,), seed=3)[0], max_tokens=2000, temperature=0.0, ignore_eos=True,
                                request_id="abort-me")
        kinds, tokens = [], 0
        async for response in stub.Generate(request, timeout=120):
            kinds.append(response.WhichOneof("kind"))
            tokens += len(response.chunk.token_ids)
            if tokens >= 3 and len(kinds) == 3:
                assert (await stub.Abort(gateway_pb2.AbortRequest(request_id="abort-me"), timeout=10)).found
            if kinds[-1] == "complete":
                assert response.request_id == "abort-me"
                assert response.complete.finish_reason == gateway_pb2.Complete.FINISH_REASON_ABORT
        assert kinds[-1] == "complete" and tokens < 2000
        assert not (await stub.Abort(gateway_pb2.AbortRequest(request_id="abort-me"), timeout=10)).found
    load = await wait_for_free_pages(decode, baseline)
    assert at_rest(load, baseline), load


async def test_cancel_during_prefill_and_deadline_free_pages(cluster):
    """A request cancelled while its 2048-token prompt is being prefilled, and one whose deadline passes
    first, both leave the decode pool at its baseline (the lease is released after prefill stops)."""
    decode = worker_address(cluster, "decode-0")
    baseline = await idle_free_pages(decode)
    prompt = token_prompts((2048,), seed=4)[0]
    async with gateway_stub(cluster.gateway_address) as stub:
        # 1024 tokens past EOS keep the request in flight for many polls: with only 8 a loaded machine could
        # finish it between two polls, and the wait below would never see it.
        call = stub.Generate(build_request(prompt, max_tokens=1024, temperature=0.0, ignore_eos=True), timeout=300)
        await _until_in_flight(worker_address(cluster, "prefill-0"), decode)
        call.cancel()
        # 1024 tokens past EOS: a request that could finish within its 50 ms (8 tokens did, on an idle machine once
        # the first-token path got faster) would not test the deadline at all. The deadline ends the call either
        # way round: the client's own timer fires first (the status), or, on a loaded machine, the gateway sees it
        # pass first and its Error message arrives before the status (generate() keeps that, swallowing the status).
        try:
            result = await generate(stub, build_request(prompt[::-1], max_tokens=1024, temperature=0.0,
                                                        ignore_eos=True), timeout=0.05)
        except grpc.aio.AioRpcError as error:
            code = error.code()
        else:
            assert result.error is not None, "a 1024-token request finished within 50 ms"
            code = next(c for c in grpc.StatusCode if c.value[0] == result.error.code)
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    load = await wait_for_free_pages(decode, baseline, timeout=120)
    assert at_rest(load, baseline), load


async def _until_in_flight(prefill: str, decode: str, timeout: float = 120.0) -> None:
    """Waits until a request is being prefilled (or, if prefill was quicker than one poll, decoded)."""
    deadline = time.monotonic() + timeout
    while (await prefill_load(prefill)).queued_requests == 0 and (await decode_load(decode)).running == 0:
        assert time.monotonic() < deadline, "the request never reached the workers"
        await asyncio.sleep(0.005)


async def _health_until(health: health_pb2_grpc.HealthStub, expected: int, timeout: float = 30.0) -> int:
    """Polls Check until it reports `expected` (the gateway's load poll has seen its workers); fails loudly."""
    deadline = time.monotonic() + timeout
    while (status := (await health.Check(health_pb2.HealthCheckRequest(), timeout=5)).status) != expected:
        assert time.monotonic() < deadline, f"health stayed {status}, expected {expected}"
        await asyncio.sleep(0.02)
    return status


async def test_model_info_and_health(cluster):
    """GetModelInfo describes the served model; grpc.health.v1 says SERVING for the gateway and workers."""
    async with gateway_stub(cluster.gateway_address) as stub:
        info = await stub.GetModelInfo(gateway_pb2.GetModelInfoRequest(), timeout=10)
    assert (info.vocab_size, info.max_context, list(info.eos_token_ids), info.has_tokenizer) == (320, 4096, [1], True)
    for address in (cluster.gateway_address, worker_address(cluster, "prefill-0"), worker_address(cluster, "decode-0")):
        async with grpc.aio.insecure_channel(address) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING, address


def _unused_address() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


async def test_gateway_health_follows_its_workers(cluster, service_model, tmp_path):
    """A gateway whose prefill worker is unreachable reports NOT_SERVING (and fails requests with
    UNAVAILABLE); one whose workers all answer reports SERVING."""
    decode = worker_address(cluster, "decode-0")
    statuses = {}
    for name, prefill in (("dead", _unused_address()), ("live", worker_address(cluster, "prefill-0"))):
        stop, ready = asyncio.Event(), tmp_path / f"{name}.addr"
        config = GatewayConfig(model_dir=str(service_model), prefill=(prefill,), decode=(decode,),
                               listen="127.0.0.1:0", load_poll_interval_s=0.05, worker_timeout_s=0.5,
                               disagg_threshold_tokens=0)  # (a short prompt would not need the prefill worker)
        task = asyncio.create_task(serve_gateway(config, stop=stop, ready_file=str(ready)))
        try:
            deadline = time.monotonic() + 30
            while not ready.exists():
                assert time.monotonic() < deadline and not task.done()
                await asyncio.sleep(0.02)
            address = ready.read_text().strip()
            async with grpc.aio.insecure_channel(address) as channel:
                health = health_pb2_grpc.HealthStub(channel)
                statuses[name] = await _health_until(health, EXPECTED_HEALTH[name])
                if name == "dead":
                    result = await generate(gateway_pb2_grpc_stub(channel), GOOD, timeout=20)
                    assert result.error is not None and result.error.code == grpc.StatusCode.UNAVAILABLE.value[0]
                    assert not result.token_ids
        finally:
            stop.set()
            await task
    assert statuses == EXPECTED_HEALTH


def gateway_pb2_grpc_stub(channel: grpc.aio.Channel):
    from rpc.v1 import gateway_pb2_grpc

    return gateway_pb2_grpc.GatewayServiceStub(channel)


async def test_top_logprobs_come_with_every_token(cluster):
    """top_logprobs=3: one TokenLogprob per generated token (the first from prefill included), each with
    3 alternatives; under greedy sampling the chosen token is the most likely one."""
    async with gateway_stub(cluster.gateway_address) as stub:
        result = await generate(stub, build_request(token_prompts((30,), seed=8)[0], max_tokens=6, temperature=0.0,
                                                    ignore_eos=True, top_logprobs=3), timeout=60)
    assert len(result.logprobs) == len(result.token_ids) == 6
    for token, logprob in zip(result.token_ids, result.logprobs):
        assert logprob.token_id == token and len(logprob.top) == 3
        assert logprob.top[0].token_id == token and logprob.logprob == pytest.approx(logprob.top[0].logprob)
        assert logprob.top[0].logprob >= logprob.top[1].logprob >= logprob.top[2].logprob


async def test_first_token_can_finish_the_request(cluster, llm):
    """When prefill's token already ends the request (max_tokens=1, or a stop token), the reservation is
    released without a Decode call: one token, the right finish reason, the pool back at its baseline."""
    decode = worker_address(cluster, "decode-0")
    baseline = await idle_free_pages(decode)
    prompt = token_prompts((50,), seed=12)[0]
    first, second = llm.generate([prompt], greedy(2))[0]
    async with gateway_stub(cluster.gateway_address) as stub:
        length = await generate(stub, build_request(prompt, max_tokens=1, temperature=0.0), timeout=60)
        stopped = await generate(stub, build_request(prompt, max_tokens=8, temperature=0.0, stop_token_ids=[first]),
                                 timeout=60)
        later = await generate(stub, build_request(prompt, max_tokens=8, temperature=0.0, stop_token_ids=[second]),
                               timeout=60)
    assert (length.token_ids, length.finish_reason) == ([first], "LENGTH")
    assert (stopped.token_ids, stopped.finish_reason) == ([first], "STOP")
    assert (later.token_ids, later.finish_reason) == ([first, second], "STOP")
    load = await wait_for_free_pages(decode, baseline)
    assert at_rest(load, baseline), load
