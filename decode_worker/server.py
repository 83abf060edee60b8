"""The decode worker process: DecodeService behind gRPC (Decode + KVTransfer + health + reflection)."""
from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc

from decode_worker.config import DecodeWorkerConfig
from decode_worker.servicer import DecodeServicer
from decode_worker.service import DecodeService
from kvtransfer.destination import TransportKind
from kvtransfer.grpc_receiver import PushReceiver
from kvtransfer.grpc_servicer import KVTransferAioServicer
from kvtransfer.shm_pool import SharedPagePool, cleanup_stale_segments
from kvtransfer.shm_receiver import ShmReceiver
from pdserve import serving
from pdserve.interceptors import server_interceptors
from pdserve.v1 import kv_pb2, kv_pb2_grpc, worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)
SERVICE_NAMES = (
    worker_pb2.DESCRIPTOR.services_by_name["Decode"].full_name,
    kv_pb2.DESCRIPTOR.services_by_name["KVTransfer"].full_name,
)


class _Receivers:
    """Attaches the engine's per-rank pools once and builds one receiver per transport over them."""

    def __init__(self) -> None:
        self.pools: list[SharedPagePool] = []
        self.push: PushReceiver | None = None

    def __call__(self, engine: Any) -> dict[TransportKind, Any]:
        self.pools = [SharedPagePool.attach(name, engine.layout) for name in engine.pool_names]
        self.push = PushReceiver([pool.cache for pool in self.pools])
        return {TransportKind.SHM: ShmReceiver(self.pools), TransportKind.GRPC: self.push}

    def close(self) -> None:
        for pool in self.pools:
            pool.close()


async def serve(config: DecodeWorkerConfig, stop: asyncio.Event | None = None, ready_file: str | None = None) -> None:
    """Runs until SIGTERM / SIGINT (or `stop`); then stops taking requests and shuts the engine down."""
    removed = cleanup_stale_segments()
    if removed:
        logger.info("removed %d stale KV pool segment(s)", len(removed))
    receivers = _Receivers()
    service = DecodeService(config, receivers)
    await service.start()
    server = grpc.aio.server(options=serving.SERVER_OPTIONS, interceptors=server_interceptors(config.internal_token))
    worker_pb2_grpc.add_DecodeServicer_to_server(DecodeServicer(service), server)
    assert receivers.push is not None
    kv_pb2_grpc.add_KVTransferServicer_to_server(KVTransferAioServicer(receivers.push), server)
    health = serving.add_health_and_reflection(server, SERVICE_NAMES)
    port = server.add_insecure_port(config.listen)
    address = serving.bound_address(config.listen, port)
    receivers.push.advertise([config.advertise_address or address] * len(receivers.pools))
    await server.start()
    await serving.set_serving(health, SERVICE_NAMES, True)
    logger.info("decode worker serving on %s (tp=%d, %d pages)", address, config.tp_size, service.load.total_pages)
    serving.write_ready_file(ready_file, address)
    try:
        await serving.wait_for_stop_signal(stop)
    finally:
        logger.info("decode worker stopping")
        await health.enter_graceful_shutdown()
        await server.stop(grace=2.0)
        await service.stop()
        receivers.close()
        logger.info("decode worker stopped")
