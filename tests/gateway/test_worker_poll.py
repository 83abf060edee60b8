"""WorkerPool.poll_once: the gateway reads each worker's WorkerPlacement from its load answer (fake stubs),
which is what --transport auto decides from."""
from __future__ import annotations

from gateway.config import GatewayConfig
from gateway.transport_choice import Placement
from gateway.workers import WorkerPool
from rpc.internal.v1 import worker_pb2


class _FakePrefill:
    async def GetPrefillLoad(self, request, timeout=None, metadata=()):  # noqa: N802 - gRPC method name
        placement = worker_pb2.WorkerPlacement(node_id="node-a", tp_size=2, device="cuda")
        return worker_pb2.GetPrefillLoadResponse(queued_requests=1, placement=placement)


class _FakeDecode:
    def __init__(self, total_state_slots: int = 0) -> None:
        self.total_state_slots = total_state_slots

    async def GetDecodeLoad(self, request, timeout=None, metadata=()):  # noqa: N802 - gRPC method name
        placement = worker_pb2.WorkerPlacement(node_id="node-a", tp_size=1, device="cpu", kv_pool="shm")
        return worker_pb2.GetDecodeLoadResponse(free_pages=40, total_pages=64, headroom_pages=4, page_size=32,
                                                placement=placement, free_state_slots=3,
                                                total_state_slots=self.total_state_slots)


async def test_poll_reads_both_placements():
    """After one polling round the prefill worker's placement holds its node and engine device, the decode
    worker's its node and pool kind, and the decode page and state slot counts are taken from the same answer
    (no state slots in the pool: None, which the standing leases' room check reads as "no limit")."""
    pool = WorkerPool(GatewayConfig(model_dir="unused", prefill=("127.0.0.1:1",), decode=("127.0.0.1:2",)))
    try:
        pool.prefill[0].stub, pool.decode[0].stub = _FakePrefill(), _FakeDecode()
        await pool.poll_once()
        assert pool.prefill[0].load.placement == Placement("node-a", device="cuda")
        decode = pool.decode[0].load
        assert decode.placement == Placement("node-a", kv_pool="shm")
        assert (decode.free_pages, decode.total_pages, decode.page_size) == (36, 64, 32)
        assert decode.free_state_slots is None  # a model without state slots
        assert pool.prefill[0].load.healthy and decode.healthy and pool.polled.is_set()
        pool.decode[0].stub = _FakeDecode(total_state_slots=8)
        await pool.poll_once()
        assert decode.free_state_slots == 3
    finally:
        await pool.close()
