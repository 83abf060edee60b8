"""One way through for a request: prefills and decodes go over the workers' multiplexed streams only (the
unary Prefill / Decode RPCs and their --no-prefill-stream / --no-decode-stream switches are gone), and a decode
worker always runs its engine in a process of its own (no --[no-]engine-process)."""
from __future__ import annotations

import argparse
import dataclasses

import pytest

from decode_worker.config import DecodeWorkerConfig
from decode_worker.process_port import ProcessPort
from decode_worker.service import DecodeService
from gateway.config import GatewayConfig
from gateway.decode_stream import DecodeCall, DecodeStream
from gateway.prefill_stream import PrefillStream
from gateway.workers import WorkerPool
from pdserve.commands import decode, gateway, up
from rpc.internal.v1 import worker_pb2, worker_pb2_grpc


@pytest.mark.parametrize("command, flag", [
    (gateway, "--no-prefill-stream"), (gateway, "--prefill-stream"), (gateway, "--no-decode-stream"),
    (gateway, "--decode-stream"), (decode, "--no-engine-process"), (decode, "--engine-process"),
    (up, "--no-engine-process"), (up, "--engine-process"),
])
def test_the_switches_of_the_second_path_are_gone(command, flag):
    """The commands refuse the flags that chose the unary RPCs or the engine thread (and accept their others)."""
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    required = ["--model", "m", "--prefill", "127.0.0.1:1", "--decode", "127.0.0.1:2"] if command is gateway else []
    known, unknown = parser.parse_known_args([*required, flag])
    assert unknown == [flag]


def test_configs_have_no_second_path():
    """GatewayConfig and DecodeWorkerConfig have no field choosing another path."""
    assert not {"prefill_stream", "decode_stream"} & {f.name for f in dataclasses.fields(GatewayConfig)}
    assert "engine_process" not in {f.name for f in dataclasses.fields(DecodeWorkerConfig)}


def test_the_worker_services_have_no_unary_prefill_or_decode():
    """The internal protos keep PrefillStream / DecodeStream only: no Prefill or Decode method (Cancel, Reserve,
    Release and the load calls stay)."""
    prefill = worker_pb2.DESCRIPTOR.services_by_name["PrefillService"]
    decode_service = worker_pb2.DESCRIPTOR.services_by_name["DecodeService"]
    assert {m.name for m in prefill.methods} == {"PrefillStream", "Cancel", "GetPrefillLoad"}
    assert {m.name for m in decode_service.methods} == {"Reserve", "DecodeStream", "Release", "GetDecodeLoad"}
    assert not hasattr(worker_pb2_grpc.PrefillServiceServicer, "Prefill")
    assert not hasattr(worker_pb2_grpc.DecodeServiceServicer, "Decode")


async def test_the_pool_sends_every_request_over_the_workers_streams():
    """Each worker of the pool holds its stream, which takes every request to it."""
    config = GatewayConfig(model_dir="unused", prefill=("127.0.0.1:1",), decode=("127.0.0.1:2",))
    pool = WorkerPool(config)
    try:
        assert isinstance(pool.prefill[0].stream, PrefillStream) and isinstance(pool.decode[0].stream, DecodeStream)
        call = pool.decode[0].stream.submit(worker_pb2.DecodeRequest(request_id="r"), 5.0, "trace")
        assert isinstance(call, DecodeCall) and call.cancel()  # (nothing listens on port 2: only dropped)
        answer = pool.prefill[0].stream.submit(worker_pb2.PrefillRequest(request_id="p"), 5.0, "trace")
        assert answer.cancel()
    finally:
        await pool.close()


def test_the_decode_service_runs_its_engine_in_a_process():
    """Without a port_factory (tests only), DecodeService's engine port is the engine process."""
    service = DecodeService(DecodeWorkerConfig.build(), lambda engine: {})
    assert isinstance(service._port, ProcessPort)
