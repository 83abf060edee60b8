"""rpc.convert.load_method: the one Get*Load RPC body both workers' servicers use."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from types import SimpleNamespace

from rpc.convert import load_method
from rpc.internal.v1 import worker_pb2
from rpc.processes import node_id


@dataclass(frozen=True)
class _DecodeLoad:
    free_pages: int
    total_pages: int
    tp_size: int
    requests_total: int


class _Servicer:
    GetDecodeLoad = load_method(worker_pb2.GetDecodeLoadResponse, "device", "kv_pool")

    def __init__(self, load: _DecodeLoad) -> None:
        engine = SimpleNamespace(device="cpu", kv_pool="shm", page_size=16)
        self._service = SimpleNamespace(load=load, config=SimpleNamespace(engine=engine))


class _Context:
    def invocation_metadata(self) -> tuple:
        return ()


def test_load_method_answers_the_service_load_with_the_named_engine_fields_as_placement():
    """The RPC reads the service's load snapshot at call time and puts exactly the named engine-config
    fields (not others) in the placement, beside this node's id and the TP size."""
    servicer = _Servicer(_DecodeLoad(90, 128, 2, 7))
    message = asyncio.run(servicer.GetDecodeLoad(worker_pb2.GetDecodeLoadRequest(), _Context()))
    assert (message.free_pages, message.total_pages, message.requests_total) == (90, 128, 7)
    assert message.placement == worker_pb2.WorkerPlacement(node_id=node_id(), tp_size=2, device="cpu", kv_pool="shm")
    servicer._service.load = _DecodeLoad(10, 128, 2, 8)
    again = asyncio.run(servicer.GetDecodeLoad(worker_pb2.GetDecodeLoadRequest(), _Context()))
    assert (again.free_pages, again.requests_total) == (10, 8)
