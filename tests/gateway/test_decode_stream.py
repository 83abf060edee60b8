"""The gateway's DecodeStream (gateway/decode_stream.py) against real decode worker servers in this process (the
real servicer over a scripted service, tests/decode_worker/stream_server.py): concurrent requests share one
stream and each iterates its own chunks; failures are AioRpcErrors with the unary call's code (INVALID_ARGUMENT
with its details, NOT_FOUND, DEADLINE_EXCEEDED kept locally too, UNAUTHENTICATED); a worker that dies fails
its running requests UNAVAILABLE and the next request opens a new stream; cancel() aborts the request on the
worker and the stream serves on; closing fails what is running; a silent worker meets the local deadline."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from gateway.decode_stream import DecodeCall, DecodeStream
from rpc.interceptors import token_metadata
from rpc.internal.v1 import worker_pb2, worker_pb2_grpc
from tests.decode_worker.stream_server import FIRST, TOKEN, StreamWorker, decode_request, serving, start_worker, stop_worker
from tests.services.helpers import eventually


@pytest.fixture
async def worker() -> AsyncIterator[StreamWorker]:
    async with serving() as running:
        yield running


def _client(worker: StreamWorker, token: str | None = TOKEN) -> tuple[grpc.aio.Channel, DecodeStream]:
    channel = grpc.aio.insecure_channel(worker.address)
    return channel, DecodeStream(worker_pb2_grpc.DecodeServiceStub(channel), token_metadata(token), worker.address)


async def _collect(call: DecodeCall) -> list[int]:
    return [token async for chunk in call for token in chunk.token_ids]


async def _streaming(worker: StreamWorker, names: list[str]) -> None:
    """Waits until the requests stream on the worker, then delivers their first step (prefill's token again)."""
    await eventually(lambda: worker.service.open() == set(names), f"{names} to stream")
    worker.service.step(names, FIRST)


async def test_concurrent_requests_share_one_stream_and_get_their_own_chunks(worker):
    """Sixteen requests through one DecodeStream, three steps each: every call yields its own tokens and ends
    after its finished chunk; the worker saw one stream, not a call per request."""
    channel, stream = _client(worker)
    try:
        names = [f"d{index}" for index in range(16)]
        calls = {name: stream.submit(decode_request(name), 30, "trace") for name in names}
        collected = {name: asyncio.ensure_future(_collect(call)) for name, call in calls.items()}
        await _streaming(worker, names)
        worker.service.step(names, 11)
        worker.service.step(names, 12)
        worker.service.step(names, 13, finished=tuple(names))
        assert {name: await asyncio.wait_for(task, 60) for name, task in collected.items()} == {
            name: [11, 12, 13] for name in names}
        assert len(worker.servicer._streams._sessions) == 1
        assert stream._open is not None and not stream._open.pending
    finally:
        await stream.close()
        await channel.close()


async def test_a_failed_request_raises_the_unary_status_and_the_stream_goes_on(worker):
    """INVALID_ARGUMENT from the worker is an AioRpcError with that code, its message and the BadRequest detail;
    an unknown lease is NOT_FOUND; the next request uses the same stream."""
    channel, stream = _client(worker)
    try:
        bad = decode_request("bad")
        bad.sampling.distribution.temperature = -1.0
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await _collect(stream.submit(bad, 30))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details().startswith("sampling")
        details = dict(refused.value.trailing_metadata())["grpc-status-details-bin"]
        violation = error_details_pb2.BadRequest()
        assert status_pb2.Status.FromString(details).details[0].Unpack(violation)
        assert violation.field_violations[0].field == "sampling"
        opened = stream._open
        with pytest.raises(grpc.aio.AioRpcError) as lost:
            await _collect(stream.submit(decode_request("lost", lease_id="nope"), 30))
        assert lost.value.code() == grpc.StatusCode.NOT_FOUND
        good = asyncio.ensure_future(_collect(stream.submit(decode_request("good"), 30)))
        await _streaming(worker, ["good"])
        worker.service.step(["good"], 11, finished=("good",))
        assert await asyncio.wait_for(good, 60) == [11]
        assert stream._open is opened
    finally:
        await stream.close()
        await channel.close()


async def test_cancel_aborts_the_request_on_the_worker_and_the_stream_serves_on(worker):
    """cancel() mid-stream (as the orchestrator's cleanup): iterating raises CancelledError, the worker aborts
    and releases the request, another request on the stream still gets its chunks."""
    channel, stream = _client(worker)
    try:
        gone, kept = stream.submit(decode_request("gone"), 30), stream.submit(decode_request("kept"), 30)
        await _streaming(worker, ["gone", "kept"])
        worker.service.step(["gone", "kept"], 11)
        assert [(await anext(call)).token_ids for call in (gone, kept)] == [[11], [11]]
        assert gone.cancel() and not gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await anext(gone)
        await eventually(lambda: worker.service.aborted == ["gone"] and worker.service.released == ["gone"],
                         "the worker to abort and release the cancelled request")
        worker.service.step(["kept"], 12, finished=("kept",))
        assert await asyncio.wait_for(_collect(kept), 60) == [12]
    finally:
        await stream.close()
        await channel.close()


async def test_the_deadline_is_kept_by_the_gateway_and_sent_to_the_worker(worker):
    """A request that outlives its timeout fails DEADLINE_EXCEEDED, and the worker aborts and releases it too
    (by its own timer, or the cancel the gateway's sends)."""
    channel, stream = _client(worker)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as late:
            await _collect(stream.submit(decode_request("late"), 1.0))
        assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await eventually(lambda: worker.service.aborted == ["late"] and worker.service.released == ["late"],
                         "the worker to abort the request")
    finally:
        await stream.close()
        await channel.close()


async def test_a_worker_that_dies_fails_running_requests_unavailable_and_the_stream_reopens():
    """The server goes away while two requests stream: both fail UNAVAILABLE (after the chunks they had); a
    worker back on the same address serves the next request over a new stream."""
    first = await start_worker()
    channel, stream = _client(first)
    port = int(first.address.rsplit(":", 1)[1])
    try:
        calls = [stream.submit(decode_request(name), 30) for name in ("a", "b")]
        await _streaming(first, ["a", "b"])
        first.service.step(["a", "b"], 11)
        assert [(await anext(call)).token_ids for call in calls] == [[11], [11]]
        broken = stream._open
        await stop_worker(first)
        for call in calls:
            with pytest.raises(grpc.aio.AioRpcError) as lost:
                await anext(call)
            assert lost.value.code() == grpc.StatusCode.UNAVAILABLE
        revived = await start_worker(port=port)
        try:
            again = asyncio.ensure_future(_collect(stream.submit(decode_request("c"), 30)))
            await _streaming(revived, ["c"])
            revived.service.step(["c"], 21, finished=("c",))
            assert await asyncio.wait_for(again, 60) == [21]
            assert stream._open is not broken
        finally:
            await stop_worker(revived)
    finally:
        await stop_worker(first)
        await stream.close()
        await channel.close()


async def test_a_refused_stream_passes_its_code_and_close_fails_running(worker):
    """Without the token the request fails UNAUTHENTICATED (not UNAVAILABLE: the worker is up); after close() a
    running request fails CANCELLED and new ones are refused."""
    channel, stream = _client(worker, token=None)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await _collect(stream.submit(decode_request("n"), 30))
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        await channel.close()
    channel, stream = _client(worker)
    try:
        running = stream.submit(decode_request("p"), 30)
        await _streaming(worker, ["p"])
        await stream.close()
        for call in (running, stream.submit(decode_request("q"), 30)):
            with pytest.raises(grpc.aio.AioRpcError) as closed:
                await _collect(call)
            assert closed.value.code() == grpc.StatusCode.CANCELLED
        await eventually(lambda: worker.service.aborted == ["p"], "the worker to abort the running request")
    finally:
        await channel.close()


async def test_a_refused_stream_is_unauthenticated_every_time(worker):
    """Forty fresh streams without the token, each on its own channel: every request fails UNAUTHENTICATED.
    The gateway writes nothing before the worker accepts the stream: a first write racing the worker's refusal
    once ended a CI run's request with gRPC core's INTERNAL, reported as UNAVAILABLE (a rare race: this guards
    against its return, it does not force it)."""
    codes = []
    for index in range(40):
        channel, stream = _client(worker, token=None)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await _collect(stream.submit(decode_request(f"n{index}"), 30))
            codes.append(refused.value.code())
        finally:
            await stream.close()
            await channel.close()
    assert codes == [grpc.StatusCode.UNAUTHENTICATED] * 40


class _SilentDecode(worker_pb2_grpc.DecodeServiceServicer):
    """Takes every DecodeStream message and never answers (a hung worker)."""

    def __init__(self) -> None:
        self.received: list[tuple[str, int]] = []

    async def DecodeStream(self, requests: Any, context: grpc.aio.ServicerContext) -> None:  # noqa: N802
        await context.send_initial_metadata(())  # accepts the stream, as the workers do
        async for message in requests:
            self.received.append((message.request.request_id or message.cancel_request_id, message.timeout_ms))
        await asyncio.Event().wait()


async def test_a_worker_that_never_answers_fails_the_request_at_the_local_deadline():
    """The worker takes the request and stays silent: the gateway's own timer (the deadline plus
    LOCAL_DEADLINE_GRACE_S) fails it DEADLINE_EXCEEDED and sends a cancel; the request carried its timeout_ms."""
    silent = _SilentDecode()
    server = grpc.aio.server()
    worker_pb2_grpc.add_DecodeServiceServicer_to_server(silent, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stream = DecodeStream(worker_pb2_grpc.DecodeServiceStub(channel), (), "silent")
    try:
        with pytest.raises(grpc.aio.AioRpcError) as late:
            await _collect(stream.submit(worker_pb2.DecodeRequest(request_id="hung"), 0.05))
        assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await eventually(lambda: len(silent.received) == 2, "the request and its cancel")
        assert silent.received == [("hung", 50), ("hung", 0)]
    finally:
        await stream.close()
        await channel.close()
        await server.stop(None)
