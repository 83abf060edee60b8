"""DecodeStream on the decode worker (decode_worker/decode_stream.py): the real servicer over a scripted service
whose engine deliveries the test makes (tests/decode_worker/stream_server.py). One delivery for N requests is
one message; updates that pile up while a write is in flight are merged per request, never past a finished
one; a cancel message, the stream's end and a request's timeout abort and release that request only; a failed
request is an error entry with the unary status and the stream serves on; the token is checked when the stream
opens; drain lets running requests finish and be sent, then ends the stream."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
from google.rpc import error_details_pb2, status_pb2

from decode_worker.admission import DecodeUpdate
from decode_worker.decode_stream import Outbox
from decode_worker.servicer import DecodeServicer
from rpc.interceptors import token_metadata
from rpc.status import Unavailable, status_of
from rpc.internal.v1 import worker_pb2, worker_pb2_grpc
from tests.decode_worker.stream_server import FIRST, TOKEN, ScriptedService, StreamWorker, decode_request
from tests.services.helpers import eventually


def _open(worker: StreamWorker, token: str | None = TOKEN) -> tuple[grpc.aio.Channel, grpc.aio.StreamStreamCall]:
    channel = grpc.aio.insecure_channel(worker.address)
    return channel, worker_pb2_grpc.DecodeServiceStub(channel).DecodeStream(metadata=token_metadata(token))


def _start(request: worker_pb2.DecodeRequest, timeout_ms: int = 0) -> worker_pb2.DecodeStreamRequest:
    return worker_pb2.DecodeStreamRequest(request=request, timeout_ms=timeout_ms, trace_id="trace-" + request.request_id)


async def _started(call: grpc.aio.StreamStreamCall, service: ScriptedService, request_ids: list[str]) -> None:
    """Starts the requests and waits until each streams, then delivers their first step (prefill's token again,
    which no update carries)."""
    for request_id in request_ids:
        await call.write(_start(decode_request(request_id)))
    await eventually(lambda: service.open() == set(request_ids), f"{request_ids} to stream")
    service.step(request_ids, FIRST)


async def _read(call: grpc.aio.StreamStreamCall) -> worker_pb2.DecodeStreamResponse:
    message = await asyncio.wait_for(call.read(), 60)
    assert message is not grpc.aio.EOF
    return message


def _tokens(message: worker_pb2.DecodeStreamResponse) -> dict[str, list[int]]:
    return {update.request_id: list(update.token_ids) for update in message.updates}


async def test_one_delivery_for_many_requests_is_one_message(stream_worker):
    """Six requests on one stream, three engine steps delivered one at a time: each delivery comes back as one
    message with one update per request (the last ones finished, "length"); the next message is a later
    request's, so no other message was sent in between."""
    service, names = stream_worker.service, [f"r{index}" for index in range(6)]
    channel, call = _open(stream_worker)
    try:
        await _started(call, service, names)
        for token in (11, 12):
            service.step(names, token)
            message = await _read(call)
            assert _tokens(message) == {name: [token] for name in names} and not message.errors
            assert not any(update.finished for update in message.updates)
        service.step(names, 13, finished=tuple(names))
        last = await _read(call)
        assert _tokens(last) == {name: [13] for name in names}
        assert all(update.finished and update.finish_reason == "length" for update in last.updates)
        await _started(call, service, ["later"])
        service.step(["later"], 21)
        assert _tokens(await _read(call)) == {"later": [21]}
        assert service.released == [] and service.aborted == []  # finished requests hold nothing more
    finally:
        call.cancel()
        await channel.close()


class _SlowContext:
    """A ServicerContext whose writes wait for `gate` (a client that reads slowly), recording each message."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.written: list[worker_pb2.DecodeStreamResponse] = []

    async def send_initial_metadata(self, metadata) -> None:  # the stream is accepted at once
        pass

    async def write(self, message: worker_pb2.DecodeStreamResponse) -> None:
        self.written.append(message)
        await self.gate.wait()


async def _requests(queue: asyncio.Queue) -> AsyncIterator[worker_pb2.DecodeStreamRequest]:
    while (message := await queue.get()) is not None:
        yield message


async def test_updates_that_pile_up_behind_a_write_are_merged_per_request():
    """While the first message's write hangs, two more steps are delivered (A finishes in the second): the next
    message has one entry per request with both steps' tokens in order, the steps summed, A finished."""
    service, context, queue = ScriptedService(), _SlowContext(), asyncio.Queue()
    servicer = DecodeServicer(service)  # type: ignore[arg-type]
    serving = asyncio.create_task(servicer.DecodeStream(_requests(queue), context))  # type: ignore[arg-type]
    try:
        for name in ("A", "B"):
            queue.put_nowait(_start(decode_request(name)))
        await eventually(lambda: service.open() == {"A", "B"}, "A and B to stream")
        service.step(["A", "B"], FIRST)
        service.step(["A", "B"], 11)
        await eventually(lambda: len(context.written) == 1, "the first write")
        outbox = next(iter(servicer._streams._sessions))._outbox
        for count, step in enumerate((lambda: service.step(["A", "B"], 12),
                                      lambda: service.step(["A", "B"], 13, finished=("A",))), start=1):
            step()  # (each taken from the mailboxes before the next: two updates per request in the outbox)
            await eventually(lambda: [len(updates) for _, updates in outbox._updates] == [count] * 2,
                             f"step {count} in the outbox")
        context.gate.set()
        await eventually(lambda: len(context.written) == 2, "the second write")
        first, merged = context.written
        assert _tokens(first) == {"A": [11], "B": [11]}
        assert _tokens(merged) == {"A": [12, 13], "B": [12, 13]}
        entries = {update.request_id: update for update in merged.updates}
        assert entries["A"].finished and entries["A"].finish_reason == "length" and not entries["B"].finished
        assert entries["A"].decode_steps == entries["B"].decode_steps == 2
    finally:
        queue.put_nowait(None)
        context.gate.set()
        await asyncio.wait_for(serving, 60)
    assert service.aborted == ["B"] and service.released == ["B"]  # the stream ended with B still running


def test_the_outbox_never_merges_past_a_finished_update():
    """A request id reused after its request finished gets an entry of its own after the finished one; an error
    entry closes the request's entry too."""
    outbox = Outbox()
    outbox.add("r", DecodeUpdate([1], [], False, None, 1))
    outbox.add("r", DecodeUpdate([2], [], True, "stop", 1))
    outbox.add("r", DecodeUpdate([3], [], False, None, 1))
    outbox.add("s", DecodeUpdate([4], [], False, None, 1))
    outbox.fail("s", status_of(Unavailable("gone")))
    outbox.add("s", DecodeUpdate([5], [], False, None, 1))
    message = outbox.take()
    assert [(u.request_id, list(u.token_ids), u.finished) for u in message.updates] == [
        ("r", [1, 2], True), ("r", [3], False), ("s", [4], False), ("s", [5], False)]
    assert [(e.request_id, e.code) for e in message.errors] == [("s", grpc.StatusCode.UNAVAILABLE.value[0])]
    assert not outbox


async def test_a_cancel_message_aborts_and_releases_only_that_request(stream_worker):
    """Cancelling A on a stream that also runs B: A is aborted in the engine and released, gets nothing more;
    B's next step still arrives."""
    service = stream_worker.service
    channel, call = _open(stream_worker)
    try:
        await _started(call, service, ["A", "B"])
        await call.write(worker_pb2.DecodeStreamRequest(cancel_request_id="A"))
        await eventually(lambda: service.aborted == ["A"] and service.released == ["A"], "A to be aborted and released")
        service.step(["A", "B"], 11)
        assert _tokens(await _read(call)) == {"B": [11]}
    finally:
        call.cancel()
        await channel.close()


async def test_a_failed_request_is_an_error_entry_and_the_stream_serves_on(stream_worker):
    """An unknown lease is NOT_FOUND; a negative temperature is INVALID_ARGUMENT naming `sampling` with the
    BadRequest detail the unary call carries; both are released; the next request on the stream streams."""
    service = stream_worker.service
    channel, call = _open(stream_worker)
    try:
        await call.write(_start(decode_request("lost", lease_id="nope")))
        lost = (await _read(call)).errors
        assert [(e.request_id, e.code) for e in lost] == [("lost", grpc.StatusCode.NOT_FOUND.value[0])]
        bad_request = decode_request("bad")
        bad_request.sampling.distribution.temperature = -1.0
        await call.write(_start(bad_request))
        (bad,) = (await _read(call)).errors
        assert bad.request_id == "bad" and bad.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert bad.message.startswith("sampling")
        violation = error_details_pb2.BadRequest()
        assert status_pb2.Status.FromString(bad.status_details).details[0].Unpack(violation)
        assert violation.field_violations[0].field == "sampling"
        await eventually(lambda: service.released == ["lost", "bad"], "both to be released")
        await _started(call, service, ["good"])
        service.step(["good"], 11)
        assert _tokens(await _read(call)) == {"good": [11]}
    finally:
        call.cancel()
        await channel.close()


async def test_a_request_past_its_timeout_is_aborted_with_deadline_exceeded(stream_worker):
    """timeout_ms passes while the request streams: its error entry is DEADLINE_EXCEEDED and it is aborted and
    released; another request on the stream is untouched."""
    service = stream_worker.service
    channel, call = _open(stream_worker)
    try:
        await _started(call, service, ["long"])
        await call.write(_start(decode_request("short"), timeout_ms=50))
        (late,) = (await _read(call)).errors
        assert (late.request_id, late.code) == ("short", grpc.StatusCode.DEADLINE_EXCEEDED.value[0])
        await eventually(lambda: "short" in service.aborted and service.released == ["short"], "short to be freed")
        service.step(["long"], 11)
        assert _tokens(await _read(call)) == {"long": [11]}
    finally:
        call.cancel()
        await channel.close()


async def test_a_stream_that_ends_aborts_and_releases_its_requests(stream_worker):
    """The gateway's side of the stream goes away (cancelled) while two requests stream: both are aborted in the
    engine and released, as cancelled unary Decode calls are."""
    service = stream_worker.service
    channel, call = _open(stream_worker)
    try:
        await _started(call, service, ["A", "B"])
        call.cancel()
        await eventually(lambda: sorted(service.aborted) == ["A", "B"] and sorted(service.released) == ["A", "B"],
                         "both requests to be aborted and released")
        assert not stream_worker.servicer._streams._sessions
    finally:
        await channel.close()


async def test_a_stream_without_the_token_is_refused_when_it_opens(stream_worker):
    """The internal-token interceptor covers DecodeStream: without the token the stream ends UNAUTHENTICATED and
    no request starts."""
    channel, call = _open(stream_worker, token=None)
    try:
        # No write: the interceptor refuses on the call's metadata alone (a write racing the refusal was once
        # reported by gRPC core as INTERNAL instead of the server's status, on a loaded machine)
        assert await asyncio.wait_for(call.code(), 60) == grpc.StatusCode.UNAUTHENTICATED
        assert stream_worker.service.open() == set() and not stream_worker.service.released
    finally:
        await channel.close()


async def test_drain_lets_running_requests_finish_then_ends_the_stream(stream_worker):
    """Shutdown begins (drain) while a request streams: its last update still arrives, then the stream ends OK."""
    service = stream_worker.service
    channel, call = _open(stream_worker)
    try:
        await _started(call, service, ["d"])
        stream_worker.servicer.drain()
        service.step(["d"], 11, finished=("d",))
        last = await _read(call)
        assert _tokens(last) == {"d": [11]} and last.updates[0].finished
        assert await asyncio.wait_for(call.read(), 60) is grpc.aio.EOF
        assert await call.code() == grpc.StatusCode.OK
        assert service.aborted == [] and service.released == []
    finally:
        await channel.close()
