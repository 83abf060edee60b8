"""The gateway's --prefill-stream flag: on by default (every prefill worker gets a PrefillStream, and
PrefillWorker.prefill goes over it), off with --no-prefill-stream (unary Prefill calls on the stub)."""
from __future__ import annotations

import argparse
from typing import Any

from gateway.config import GatewayConfig
from gateway.prefill_stream import PrefillStream
from gateway.workers import WorkerPool
from pdserve.commands.gateway import add_arguments
from rpc.internal.v1 import worker_pb2

BASE = ["--prefill", "127.0.0.1:1", "--decode", "127.0.0.1:2"]


def test_the_flag_is_on_by_default_and_can_be_turned_off():
    """The CLI's default and GatewayConfig's default agree (on); --no-prefill-stream turns it off."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(BASE).prefill_stream is True
    assert parser.parse_args([*BASE, "--no-prefill-stream"]).prefill_stream is False
    assert GatewayConfig(model_dir="unused", prefill=("127.0.0.1:1",), decode=("127.0.0.1:2",)).prefill_stream is True


class _UnaryStub:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    async def Prefill(self, request: worker_pb2.PrefillRequest, timeout: Any = None, metadata: Any = ()) -> Any:  # noqa: N802
        self.calls.append((request.request_id, timeout))
        return worker_pb2.PrefillResponse(first_token=3)


async def test_the_pool_routes_prefill_over_the_stream_only_when_on():
    """With the flag on each prefill worker holds a PrefillStream that PrefillWorker.prefill uses (the stub's
    unary Prefill is not called); with it off there is none and the unary call is made with the timeout."""
    for enabled in (True, False):
        config = GatewayConfig(model_dir="unused", prefill=("127.0.0.1:1",), decode=("127.0.0.1:2",),
                               prefill_stream=enabled)
        pool = WorkerPool(config)
        worker = pool.prefill[0]
        try:
            assert isinstance(worker.stream, PrefillStream) if enabled else worker.stream is None
            stub = _UnaryStub()
            worker.stub = stub  # type: ignore[assignment]
            call = worker.prefill(worker_pb2.PrefillRequest(request_id="r"), 5.0, ())
            if enabled:
                call.cancel()  # (nothing listens on port 1: the call is only dropped)
                assert stub.calls == []
            else:
                assert (await call).first_token == 3 and stub.calls == [("r", 5.0)]
        finally:
            await pool.close()
