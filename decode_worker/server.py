"""The decode worker process: DecodeService behind gRPC (Decode + KVTransfer + KV events + health + reflection). With
an engine process (--engine-process), that process dying stops the worker with an error."""
from __future__ import annotations

import asyncio
import logging

import grpc

from decode_worker.config import DecodeWorkerConfig
from decode_worker.engine_api import EngineFigures
from decode_worker.servicer import DecodeServicer
from decode_worker.service import DecodeService
from engine.weights.device_ipc import ipc_for
from kvtransfer.destination import TransportKind
from kvtransfer.device_pool import DevicePagePool
from kvtransfer.device_transport import DeviceReceiver
from kvtransfer.staged_receiver import StagedPushReceiver
from kvtransfer.grpc_receiver import PushReceiver
from kvtransfer.layout import KVLayout
from kvtransfer.grpc_servicer import KVTransferAioServicer
from kvtransfer.shm_pool import SharedPagePool, cleanup_stale_segments
from kvtransfer.shm_receiver import ShmReceiver
from kvtransfer.transport import KVReceiver
from decode_worker.metrics import decode_registry
from rpc import server
from rpc.interceptors import server_interceptors
from rpc.kv_event_stream import KVEventPublisher, KVEventServicer
from rpc.metrics_http import serve_metrics
from rpc.internal.v1 import kv_pb2, kv_pb2_grpc, worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)
SERVICE_NAMES = (
    worker_pb2.DESCRIPTOR.services_by_name["DecodeService"].full_name,
    kv_pb2.DESCRIPTOR.services_by_name["KVTransferService"].full_name,
    worker_pb2.DESCRIPTOR.services_by_name["KVEventService"].full_name,
)


class _Receivers:
    """Attaches the engine's per-rank pools once and builds one receiver per transport over them: shm pools
    serve SHM and GRPC; device pools serve DEVICE (over their control segments) and GRPC (straight into
    host pages on the CPU stand-in; through a host mirror and a copy to the device on a GPU)."""

    def __init__(self) -> None:
        self.pools: list[SharedPagePool | DevicePagePool] = []
        self.push: PushReceiver | None = None

    def __call__(self, engine: EngineFigures) -> dict[TransportKind, KVReceiver]:
        layout = KVLayout.from_cache_shape(engine.cache_shape)
        if engine.config.kv_pool != "device":
            self.pools = [SharedPagePool.attach(name, layout) for name in engine.pool_names]
            self.push = PushReceiver([pool.cache for pool in self.pools])
            return {TransportKind.SHM: ShmReceiver(self.pools), TransportKind.GRPC: self.push}
        self.pools = [DevicePagePool.attach(name, layout, engine.device, ipc_for(engine.device)) for name in engine.pool_names]
        caches = [pool.cache for pool in self.pools]
        self.push = PushReceiver(caches) if engine.device.type == "cpu" else StagedPushReceiver(caches)
        return {TransportKind.DEVICE: DeviceReceiver(self.pools), TransportKind.GRPC: self.push}

    def close(self) -> None:
        for pool in self.pools:
            pool.close()


async def serve(config: DecodeWorkerConfig, stop: asyncio.Event | None = None, ready_file: str | None = None) -> None:
    """Runs until SIGTERM / SIGINT (or `stop`); then stops taking requests and shuts the engine down."""
    removed = cleanup_stale_segments()
    if removed:
        logger.info("removed %d stale KV pool segment(s)", len(removed))
    receivers = _Receivers()
    stop = stop or asyncio.Event()
    lost: list[str] = []

    def engine_lost(reason: str) -> None:  # fail loudly: stop serving, exit non-zero (a supervisor restarts us)
        lost.append(reason)
        stop.set()

    service = DecodeService(config, receivers, on_engine_lost=engine_lost)
    await service.start()
    push = receivers.push
    assert push is not None

    servicer = DecodeServicer(service)
    events = KVEventPublisher(lambda: service.kv_events)

    def register(grpc_server: grpc.aio.Server) -> None:
        worker_pb2_grpc.add_DecodeServiceServicer_to_server(servicer, grpc_server)
        kv_pb2_grpc.add_KVTransferServiceServicer_to_server(KVTransferAioServicer(push), grpc_server)
        worker_pb2_grpc.add_KVEventServiceServicer_to_server(KVEventServicer(events), grpc_server)

    def draining() -> None:
        servicer.drain()
        events.close()

    endpoints, stop_metrics = serve_metrics(config.metrics_listen, decode_registry(service))

    async def on_stop() -> None:
        stop_metrics()
        await service.stop()
        receivers.close()

    logger.info("decode worker: tp=%d, %d pages", config.tp_size, service.load.total_pages)
    await server.serve(
        "decode worker", config.listen, SERVICE_NAMES, register, on_stop, stop=stop, ready_file=ready_file,
        endpoints=endpoints, on_draining=draining,
        on_bound=lambda address: push.advertise([config.advertise_address or address] * len(receivers.pools)),
        interceptors=server_interceptors(config.internal_token),
    )
    if lost:
        raise RuntimeError(f"decode worker stopped: {lost[0]}")
