"""PrefillStream on a real gRPC server in this process (the real servicer and PrefillService over a fake
engine, writing into a real shm pool), driven by a raw stream call: concurrent prompts get their own answers
and completion records; a refused prompt gets the unary status and the stream serves on; a closed stream
cancels its running and queued prompts (no record, nothing queued); a per-request timeout is a deadline; the
token is checked when the stream opens; shutdown drains."""
from __future__ import annotations

import asyncio

import grpc
from google.rpc import error_details_pb2, status_pb2

from rpc.interceptors import token_metadata
from rpc.internal.v1 import worker_pb2, worker_pb2_grpc
from tests.prefill_worker.stream_server import TOKEN, StreamWorker, shm_pool, stream_worker  # noqa: F401 - fixtures
from tests.services.helpers import eventually


def _open(worker: StreamWorker, token: str | None = TOKEN) -> tuple[grpc.aio.Channel, grpc.aio.StreamStreamCall]:
    channel = grpc.aio.insecure_channel(worker.address)
    return channel, worker_pb2_grpc.PrefillServiceStub(channel).PrefillStream(metadata=token_metadata(token))


def _send(request: worker_pb2.PrefillRequest, timeout_ms: int = 0) -> worker_pb2.PrefillStreamRequest:
    return worker_pb2.PrefillStreamRequest(request=request, timeout_ms=timeout_ms, trace_id="trace-" + request.request_id)


async def _answers(call: grpc.aio.StreamStreamCall, count: int) -> dict[str, worker_pb2.PrefillStreamResponse]:
    answers = {}
    for _ in range(count):
        message = await asyncio.wait_for(call.read(), 60)
        assert message is not grpc.aio.EOF
        answers[message.request_id] = message
    return answers


async def test_concurrent_prefills_on_one_stream_get_their_own_answers(stream_worker):
    """Twelve prompts written back to back on one stream: each answer names its request and carries that
    prompt's first token, and every prompt's completion record is written (after its answer)."""
    channel, call = _open(stream_worker)
    try:
        prompts = {f"r{index}": [100 + index] * (5 + index) for index in range(12)}
        for request_id, prompt in prompts.items():
            await call.write(_send(stream_worker.request(request_id, prompt)))
        answers = await _answers(call, len(prompts))
        assert set(answers) == set(prompts)
        for request_id, prompt in prompts.items():
            assert answers[request_id].WhichOneof("result") == "response"
            assert answers[request_id].response.first_token == prompt[0]
            assert answers[request_id].response.num_prompt_tokens == len(prompt)
        await eventually(lambda: all(stream_worker.receiver.ready(r) for r in prompts), "every completion record")
    finally:
        call.cancel()
        await channel.close()


async def test_an_invalid_request_is_refused_and_the_stream_serves_the_next(stream_worker):
    """block_size above the worker's maximum: the answer is INVALID_ARGUMENT naming the field, with the
    google.rpc.BadRequest detail the unary call carries; the next prompt on the same stream is served."""
    channel, call = _open(stream_worker)
    try:
        await call.write(_send(stream_worker.request("bad", [5] * 8, block_size=1000)))
        bad = (await _answers(call, 1))["bad"]
        assert bad.WhichOneof("result") == "error"
        assert bad.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert bad.error.message.startswith("block_size")
        status = status_pb2.Status.FromString(bad.error.status_details)
        violation = error_details_pb2.BadRequest()
        assert status.details and status.details[0].Unpack(violation)
        assert violation.field_violations[0].field == "block_size"
        await call.write(_send(stream_worker.request("good", [9] * 8)))
        good = (await _answers(call, 1))["good"]
        assert good.response.first_token == 9
    finally:
        call.cancel()
        await channel.close()


async def test_a_stream_closed_mid_prefill_cancels_its_prompts(shm_pool):
    """With A running (held in the engine) and B queued behind it on one stream, the stream is cancelled: B
    leaves the queue, A is stopped between chunks, neither gets a completion record, no job is left."""
    from tests.prefill_worker.stream_server import start_worker, stop_worker

    worker = await start_worker(shm_pool, batch_tokens=8)  # one 8-token prompt per batch
    worker.engine.gate.clear()
    channel, call = _open(worker)
    try:
        await call.write(_send(worker.request("A", [1] * 8)))
        await call.write(_send(worker.request("B", [2] * 8)))
        await eventually(lambda: worker.engine.started == ["A"] and worker.service.load.queued_requests == 1,
                         "A running and B queued")
        call.cancel()
        await eventually(lambda: worker.service.load.queued_requests == 0, "B to leave the queue")
        worker.engine.gate.set()
        await eventually(lambda: not worker.service._jobs, "every job to end")
        assert worker.engine.started == ["A"] and worker.engine.stopped == ["A"]
        assert not worker.receiver.ready("A") and not worker.receiver.ready("B")
    finally:
        await channel.close()
        await stop_worker(worker)


async def test_a_request_past_its_timeout_is_cancelled_as_a_deadline(stream_worker):
    """timeout_ms passes while the prompt runs: the answer is DEADLINE_EXCEEDED, the prompt is stopped (no
    completion record), and the stream serves the next prompt."""
    stream_worker.engine.gate.clear()
    channel, call = _open(stream_worker)
    try:
        await call.write(_send(stream_worker.request("slow", [3] * 8), timeout_ms=100))
        slow = (await _answers(call, 1))["slow"]
        assert slow.error.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
        stream_worker.engine.gate.set()
        await eventually(lambda: not stream_worker.service._jobs, "the job to end")
        assert stream_worker.engine.stopped == ["slow"] and not stream_worker.receiver.ready("slow")
        await call.write(_send(stream_worker.request("next", [4] * 8), timeout_ms=60_000))
        assert (await _answers(call, 1))["next"].response.first_token == 4
    finally:
        call.cancel()
        await channel.close()


async def test_a_stream_without_the_token_is_refused_when_it_opens(stream_worker):
    """The internal-token interceptor covers PrefillStream: without the token the stream ends UNAUTHENTICATED
    and no prompt is taken."""
    channel, call = _open(stream_worker, token=None)
    try:
        try:
            await call.write(_send(stream_worker.request("x", [5] * 8)))
        except grpc.aio.AioRpcError:
            pass  # (the refusal may already have arrived)
        assert await call.code() == grpc.StatusCode.UNAUTHENTICATED
        assert stream_worker.service.load.requests_total == 0
    finally:
        await channel.close()


async def test_drain_lets_running_prompts_answer_then_ends_the_stream(stream_worker):
    """Shutdown begins (drain) while a prompt runs: its answer still arrives, then the stream ends OK."""
    stream_worker.engine.gate.clear()
    channel, call = _open(stream_worker)
    try:
        await call.write(_send(stream_worker.request("d", [6] * 8)))
        await eventually(lambda: stream_worker.engine.started == ["d"], "d to run")
        stream_worker.servicer.drain()
        stream_worker.engine.gate.set()
        assert (await _answers(call, 1))["d"].response.first_token == 6
        assert await asyncio.wait_for(call.read(), 60) is grpc.aio.EOF
        assert await call.code() == grpc.StatusCode.OK
    finally:
        await channel.close()
