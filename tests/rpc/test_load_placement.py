"""Both workers' load answers carry one WorkerPlacement (node id, TP size, engine device, pool kind), built by
rpc.convert.load_to_proto from a worker's load dataclass (rpc.convert.load_method: the RPC body around it)."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from rpc.convert import load_method, load_to_proto
from rpc.internal.v1 import worker_pb2
from rpc.processes import node_id


@dataclass(frozen=True)
class _PrefillLoad:
    queued_requests: int
    queued_tokens: int
    tp_size: int
    requests_total: int


@dataclass(frozen=True)
class _DecodeLoad:
    free_pages: int
    total_pages: int
    tp_size: int
    requests_total: int


def test_prefill_load_puts_worker_facts_in_placement():
    """The queue counters stay top-level; tp_size, this node's id and the engine device land in placement,
    and kv_pool stays empty for a prefill worker."""
    message = load_to_proto(worker_pb2.GetPrefillLoadResponse, _PrefillLoad(3, 70, 2, 9), device="cuda")
    assert (message.queued_requests, message.queued_tokens, message.requests_total) == (3, 70, 9)
    assert message.placement == worker_pb2.WorkerPlacement(node_id=node_id(), tp_size=2, device="cuda")
    assert message.placement.node_id and message.placement.kv_pool == ""


def test_decode_load_carries_pool_kind_and_round_trips():
    """A decode worker's answer names its pool kind and device in the same placement message, and the
    placement survives serialization (what the gateway's poller reads)."""
    message = load_to_proto(worker_pb2.GetDecodeLoadResponse, _DecodeLoad(90, 128, 4, 7), kv_pool="shm", device="cpu")
    parsed = worker_pb2.GetDecodeLoadResponse.FromString(message.SerializeToString())
    assert (parsed.free_pages, parsed.total_pages, parsed.requests_total) == (90, 128, 7)
    assert (parsed.placement.node_id, parsed.placement.tp_size) == (node_id(), 4)
    assert (parsed.placement.device, parsed.placement.kv_pool) == ("cpu", "shm")


def test_unknown_placement_field_is_refused():
    """A misspelt placement keyword fails loudly instead of being dropped."""
    with pytest.raises(ValueError, match="kv_pol"):
        load_to_proto(worker_pb2.GetDecodeLoadResponse, _DecodeLoad(1, 1, 1, 0), kv_pol="shm")


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
