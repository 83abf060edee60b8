"""Decode hang detection (gateway/liveness.py) against a real decode worker server in this process (the real
servicer over a scripted service): `hang_probe_failures` failed probes in a row fail the worker's running
requests UNAVAILABLE naming the hang, once, and the worker aborts them (its stream was cancelled); one answered
probe restarts the count; a stream silent past `stream_silence_s` with requests in flight fails them too, an
idle or talking stream never. No timing: silence is set on the stream's clock, not waited for."""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace

import grpc
import pytest

from gateway.decode_stream import DecodeCall, DecodeStream
from gateway.liveness import DecodeLiveness, LivenessConfig
from rpc.interceptors import token_metadata
from rpc.internal.v1 import worker_pb2_grpc
from tests.decode_worker.stream_server import FIRST, TOKEN, decode_request, serving
from tests.services.helpers import eventually


async def _failure(call: DecodeCall) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as error:
        async for _ in call:
            pass
    return error.value


async def _running(worker, stream: DecodeStream, names: list[str]) -> dict[str, DecodeCall]:
    calls = {name: stream.submit(decode_request(name), 60) for name in names}
    await eventually(lambda: worker.service.open() == set(names), f"{names} to stream")
    worker.service.step(names, FIRST)
    return calls


async def test_failed_probes_fail_the_running_requests_once_and_the_worker_aborts_them():
    async with serving() as worker:
        channel = grpc.aio.insecure_channel(worker.address)
        stream = DecodeStream(worker_pb2_grpc.DecodeServiceStub(channel), token_metadata(TOKEN), worker.address)
        try:
            view = SimpleNamespace(load=SimpleNamespace(address=worker.address), stream=stream)
            liveness = DecodeLiveness(LivenessConfig(hang_probe_failures=2, stream_silence_s=0))
            calls = await _running(worker, stream, ["a", "b"])
            liveness.probed(view, answered=False)
            liveness.probed(view, answered=True)  # an answer restarts the count
            liveness.probed(view, answered=False)
            assert all(not call.ended for call in calls.values())
            liveness.probed(view, answered=False)
            for call in calls.values():
                error = await asyncio.wait_for(_failure(call), 30)
                assert error.code() == grpc.StatusCode.UNAVAILABLE and "stopped answering" in error.details()
            await eventually(lambda: worker.service.open() == set(), "the worker to abort the hung stream's requests")
            assert sorted(worker.service.aborted) == ["a", "b"] and liveness.hangs == 1
            liveness.probed(view, answered=False)  # the same hang: nothing more to fail, not counted again
            assert liveness.hangs == 1
            liveness.probed(view, answered=True)
            again = await _running(worker, stream, ["c"])  # back: a new stream serves
            worker.service.step(["c"], 11, finished=("c",))
            assert [t async for chunk in again["c"] for t in chunk.token_ids] == [11]
        finally:
            await stream.close()
            await channel.close()


async def test_a_silent_stream_with_requests_in_flight_is_failed_an_idle_one_never():
    async with serving() as worker:
        channel = grpc.aio.insecure_channel(worker.address)
        stream = DecodeStream(worker_pb2_grpc.DecodeServiceStub(channel), token_metadata(TOKEN), worker.address)
        try:
            view = SimpleNamespace(load=SimpleNamespace(address=worker.address), stream=stream)
            liveness = DecodeLiveness(LivenessConfig(hang_probe_failures=0, stream_silence_s=50.0))
            liveness.probed(view, answered=True)  # no stream open yet
            calls = await _running(worker, stream, ["s"])
            liveness.probed(view, answered=True)  # it just spoke
            assert not calls["s"].ended
            stream._open.last_message -= 100.0  # 100 s without a step, on the stream's own clock
            liveness.probed(view, answered=True)
            error = await asyncio.wait_for(_failure(calls["s"]), 30)
            assert error.code() == grpc.StatusCode.UNAVAILABLE and "sent no step" in error.details()
            assert stream.silent_for(0.0) is None  # broken: nothing in flight on an open stream
        finally:
            await stream.close()
            await channel.close()


@contextlib.asynccontextmanager
async def _stream_to(worker) -> AsyncIterator[DecodeStream]:
    channel = grpc.aio.insecure_channel(worker.address)
    stream = DecodeStream(worker_pb2_grpc.DecodeServiceStub(channel), token_metadata(TOKEN), worker.address)
    try:
        yield stream
    finally:
        await stream.close()
        await channel.close()


async def test_a_request_after_a_long_idle_spell_is_not_taken_for_a_hang():
    """The silence clock starts when an idle stream is given a request: a stream that sat idle for longer than
    stream_silence_s (a quiet deployment) does not fail the next request the moment it is sent."""
    async with serving() as worker, _stream_to(worker) as stream:
        view = SimpleNamespace(load=SimpleNamespace(address=worker.address), stream=stream)
        liveness = DecodeLiveness(LivenessConfig(hang_probe_failures=0, stream_silence_s=50.0))
        first = await _running(worker, stream, ["a"])
        worker.service.step(["a"], 11, finished=("a",))
        await eventually(lambda: not stream._open.pending, "the first request to finish")
        assert first["a"].ended and stream.silent_for(0.0) is None  # idle: no silence counted
        stream._open.last_message -= 100.0  # then 100 s without a message, idle
        second = stream.submit(decode_request("b"), 60)
        await eventually(lambda: worker.service.open() == {"b"}, "b to stream")  # no step from the worker yet
        liveness.probed(view, answered=True)
        assert not second.ended and liveness.hangs == 0 and stream.silent_for(time.monotonic()) < 50.0


def test_liveness_settings_are_checked():
    with pytest.raises(ValueError, match="non-negative"):
        LivenessConfig(hang_probe_failures=-1)
