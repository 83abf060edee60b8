"""The gateway's PrefillStream (gateway/prefill_stream.py) against real prefill worker servers in this process
(tests/prefill_worker/stream_server.py): concurrent prompts share one stream and get their own answers;
failures are AioRpcErrors with the unary call's code (INVALID_ARGUMENT with its details, DEADLINE_EXCEEDED
kept locally too, UNAUTHENTICATED); a worker that dies fails its pending prompts UNAVAILABLE and the next
prompt opens a new stream; a cancelled prompt is dropped; closing fails what is pending; a silent worker
meets the local deadline. (RequestRun's retry on another worker: test_prefill_stream_retry.py.)"""
from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2

from gateway.prefill_stream import PrefillStream
from kvtransfer.shm_pool import SharedPagePool
from prefill_worker.service import JobState
from rpc.interceptors import token_metadata
from rpc.internal.v1 import worker_pb2, worker_pb2_grpc
from rpc.status import status_of
from tests.prefill_worker.stream_server import (  # noqa: F401 - fixtures
    LAYOUT, TOKEN, StreamWorker, shm_pool, start_worker, stop_worker, stream_worker,
)
from tests.services.helpers import eventually


def _client(worker: StreamWorker, token: str | None = TOKEN) -> tuple[grpc.aio.Channel, PrefillStream]:
    channel = grpc.aio.insecure_channel(worker.address)
    return channel, PrefillStream(worker_pb2_grpc.PrefillServiceStub(channel), token_metadata(token), worker.address)


async def test_concurrent_prefills_share_one_stream_and_get_their_own_answers(stream_worker):
    """Sixteen prompts at once through one PrefillStream: each gets its own first token, and the worker saw
    one stream (one session), not a call per prompt."""
    channel, stream = _client(stream_worker)
    try:
        prompts = {f"p{index}": [200 + index] * (3 + index) for index in range(16)}
        answers = await asyncio.gather(*(stream.prefill(stream_worker.request(rid, prompt), 30, "t")
                                         for rid, prompt in prompts.items()))
        assert [answer.first_token for answer in answers] == [prompt[0] for prompt in prompts.values()]
        assert len(stream_worker.servicer._streams._sessions) == 1
        assert stream_worker.service.load.requests_total == 16
    finally:
        await stream.close()
        await channel.close()


async def test_a_refused_prompt_raises_the_unary_status_and_the_stream_goes_on(stream_worker):
    """INVALID_ARGUMENT from the worker is an AioRpcError with that code, its message and the BadRequest
    detail (status_of passes it to the client as a unary call's would); the next prompt uses the same stream."""
    channel, stream = _client(stream_worker)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stream.prefill(stream_worker.request("bad", [5] * 8, block_size=1000), 30)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details().startswith("block_size")
        status = status_of(refused.value)
        assert status.code == grpc.StatusCode.INVALID_ARGUMENT
        opened = stream._open
        assert (await stream.prefill(stream_worker.request("good", [8] * 8), 30)).first_token == 8
        assert stream._open is opened
        details = dict(status.trailing_metadata)["grpc-status-details-bin"]
        from google.rpc import status_pb2

        violation = error_details_pb2.BadRequest()
        assert status_pb2.Status.FromString(details).details[0].Unpack(violation)
        assert violation.field_violations[0].field == "block_size"
    finally:
        await stream.close()
        await channel.close()


async def test_the_deadline_is_kept_by_the_gateway_and_sent_to_the_worker(stream_worker):
    """A prompt held past its timeout fails DEADLINE_EXCEEDED, and the worker stops it too (its own timer:
    no Cancel RPC here), writing no completion record."""
    stream_worker.engine.gate.clear()
    channel, stream = _client(stream_worker)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as late:
            await stream.prefill(stream_worker.request("late", [4] * 8), 0.2)
        assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        job = stream_worker.service._jobs["late"]  # still held in the engine
        await eventually(lambda: job.state is JobState.CANCELLED, "the worker's own timeout to cancel the prompt")
        stream_worker.engine.gate.set()
        await eventually(lambda: not stream_worker.service._jobs, "the worker to drop the prompt")
        assert stream_worker.engine.stopped == ["late"] and not stream_worker.receiver.ready("late")
    finally:
        await stream.close()
        await channel.close()


async def test_a_worker_that_dies_fails_pending_prompts_unavailable_and_the_stream_reopens(shm_pool):
    """The server goes away while two prompts are pending: both fail UNAVAILABLE; a worker back on the same
    address serves the next prompt over a new stream."""
    worker = await start_worker(shm_pool)
    worker.engine.gate.clear()
    channel, stream = _client(worker)
    port = int(worker.address.rsplit(":", 1)[1])
    try:
        pending = [stream.submit(worker.request(rid, [6] * 8), 30) for rid in ("a", "b")]
        await eventually(lambda: len(worker.service._jobs) == 2, "both prompts to reach the worker")
        await stop_worker(worker)
        for call in pending:
            with pytest.raises(grpc.aio.AioRpcError) as lost:
                await call
            assert lost.value.code() == grpc.StatusCode.UNAVAILABLE
        with SharedPagePool.create(LAYOUT, 64, num_slots=32) as second_pool:
            revived = await start_worker(second_pool, port=port)
            try:
                assert (await stream.prefill(revived.request("c", [7] * 8), 30)).first_token == 7
            finally:
                await stop_worker(revived)
    finally:
        await stop_worker(worker)
        await stream.close()
        await channel.close()


async def test_a_cancelled_prompt_is_dropped_and_the_stream_serves_on(stream_worker):
    """The caller gives up on a running prompt (its task is cancelled, as a client that went away): the call
    ends CancelledError, the Cancel RPC stops the prompt on the worker, and the stream serves the next one."""
    stream_worker.engine.gate.clear()
    channel, stream = _client(stream_worker)
    try:
        call = stream.submit(stream_worker.request("gone", [3] * 8), 30, "trace")
        await eventually(lambda: stream_worker.engine.started == ["gone"], "the prompt to run")
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        stub = worker_pb2_grpc.PrefillServiceStub(channel)
        job = stream_worker.service._jobs["gone"]
        cancel = asyncio.ensure_future(stub.Cancel(worker_pb2.CancelRequest(request_id="gone"), timeout=30,
                                                   metadata=token_metadata(TOKEN)))
        await eventually(lambda: job.state is JobState.CANCELLED, "the Cancel RPC to reach the worker")
        stream_worker.engine.gate.set()
        assert (await cancel).dropped is False  # it was running: Cancel waited until it stopped
        assert stream_worker.engine.stopped == ["gone"] and not stream_worker.receiver.ready("gone")
        assert (await stream.prefill(stream_worker.request("next", [2] * 8), 30)).first_token == 2
    finally:
        await stream.close()
        await channel.close()


async def test_a_refused_stream_passes_its_code_and_close_fails_pending(stream_worker):
    """Without the token the prompt fails UNAUTHENTICATED (not UNAVAILABLE: the worker is up); after close()
    a pending prompt fails CANCELLED and new ones are refused."""
    channel, stream = _client(stream_worker, token=None)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stream.prefill(stream_worker.request("n", [5] * 8), 30)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        await channel.close()
    stream_worker.engine.gate.clear()
    channel, stream = _client(stream_worker)
    try:
        pending = asyncio.ensure_future(stream.prefill(stream_worker.request("p", [5] * 8), 30))
        await eventually(lambda: stream_worker.engine.started == ["p"], "the prompt to run")
        await stream.close()
        for call in (pending, stream.prefill(stream_worker.request("q", [5] * 8), 30)):
            with pytest.raises(grpc.aio.AioRpcError) as closed:
                await call
            assert closed.value.code() == grpc.StatusCode.CANCELLED
    finally:
        await channel.close()


class _SilentPrefill(worker_pb2_grpc.PrefillServiceServicer):
    """Takes every PrefillStream message and never answers (a hung worker)."""

    def __init__(self) -> None:
        self.received: list[str] = []

    async def PrefillStream(self, requests: Any, context: grpc.aio.ServicerContext) -> None:  # noqa: N802
        await context.send_initial_metadata(())  # accepts the stream, as the workers do
        async for message in requests:
            self.received.append(message.request.request_id)
        await asyncio.Event().wait()


async def test_a_worker_that_never_answers_fails_the_prompt_at_the_local_deadline():
    """The worker takes the prompt and stays silent: the gateway's own timer (the deadline plus
    LOCAL_DEADLINE_GRACE_S) fails it DEADLINE_EXCEEDED; the message carried the remaining time as timeout_ms."""
    silent = _SilentPrefill()
    server = grpc.aio.server()
    worker_pb2_grpc.add_PrefillServiceServicer_to_server(silent, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stream = PrefillStream(worker_pb2_grpc.PrefillServiceStub(channel), (), "silent")
    try:
        with pytest.raises(grpc.aio.AioRpcError) as late:
            await stream.prefill(worker_pb2.PrefillRequest(request_id="hung", token_ids=[1]), 0.05)
        assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert silent.received == ["hung"]
    finally:
        await stream.close()
        await channel.close()
        await server.stop(None)
