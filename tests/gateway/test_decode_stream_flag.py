"""The gateway's --decode-stream flag: on by default (every decode worker gets a DecodeStream, and
DecodeWorker.decode goes over it), off with --no-decode-stream (a server-streaming Decode call on the stub)."""
from __future__ import annotations

import argparse
from typing import Any

from gateway.config import GatewayConfig
from gateway.decode_stream import DecodeCall, DecodeStream
from gateway.workers import WorkerPool
from pdserve.commands.gateway import add_arguments
from rpc.internal.v1 import worker_pb2

BASE = ["--prefill", "127.0.0.1:1", "--decode", "127.0.0.1:2"]


def test_the_flag_is_on_by_default_and_can_be_turned_off():
    """The CLI's default and GatewayConfig's default agree (on); --no-decode-stream turns it off."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(BASE).decode_stream is True
    assert parser.parse_args([*BASE, "--no-decode-stream"]).decode_stream is False
    assert GatewayConfig(model_dir="unused", prefill=("127.0.0.1:1",), decode=("127.0.0.1:2",)).decode_stream is True


class _UnaryStub:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def Decode(self, request: worker_pb2.DecodeRequest, timeout: Any = None, metadata: Any = ()) -> Any:  # noqa: N802
        self.calls.append((request.request_id, timeout))
        return [worker_pb2.DecodeResponse(token_ids=[3], finished=True)]


async def test_the_pool_routes_decode_over_the_stream_only_when_on():
    """With the flag on each decode worker holds a DecodeStream that DecodeWorker.decode uses (the stub's Decode
    is not called); with it off there is none and the stub's Decode is called with the timeout."""
    for enabled in (True, False):
        config = GatewayConfig(model_dir="unused", prefill=("127.0.0.1:1",), decode=("127.0.0.1:2",),
                               decode_stream=enabled)
        pool = WorkerPool(config)
        worker = pool.decode[0]
        try:
            assert isinstance(worker.stream, DecodeStream) if enabled else worker.stream is None
            stub = _UnaryStub()
            worker.stub = stub  # type: ignore[assignment]
            call = worker.decode(worker_pb2.DecodeRequest(request_id="r"), 5.0, ())
            if enabled:
                assert isinstance(call, DecodeCall) and call.cancel()  # (nothing listens on port 2: only dropped)
                assert stub.calls == []
            else:
                assert call[0].token_ids == [3] and stub.calls == [("r", 5.0)]
        finally:
            await pool.close()
