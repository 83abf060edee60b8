"""The prefill worker process: PrefillService behind gRPC (Prefill + KV events + health + reflection)."""
from __future__ import annotations

import asyncio
import logging

import grpc

from prefill_worker.config import PrefillWorkerConfig
from prefill_worker.service import PrefillService
from prefill_worker.servicer import PrefillServicer
from rpc import server
from rpc.interceptors import server_interceptors
from rpc.kv_event_stream import KVEventPublisher, KVEventServicer
from rpc.metrics_http import serve_metrics
from rpc.internal.v1 import worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)
SERVICE_NAMES = (worker_pb2.DESCRIPTOR.services_by_name["PrefillService"].full_name,
                 worker_pb2.DESCRIPTOR.services_by_name["KVEventService"].full_name)


async def serve(config: PrefillWorkerConfig, stop: asyncio.Event | None = None, ready_file: str | None = None) -> None:
    """Runs until SIGTERM / SIGINT (or `stop`); queued prompts are refused on the way out."""
    service = PrefillService(config)
    await service.start()
    logger.info("prefill worker: tp=%d", config.tp_size)
    endpoints, stop_metrics = serve_metrics(config.metrics_listen, service.metrics.registry)

    async def on_stop() -> None:
        stop_metrics()
        await service.stop()

    servicer = PrefillServicer(service)
    events = KVEventPublisher(lambda: service.kv_events)

    def register(grpc_server: grpc.aio.Server) -> None:
        worker_pb2_grpc.add_PrefillServiceServicer_to_server(servicer, grpc_server)
        worker_pb2_grpc.add_KVEventServiceServicer_to_server(KVEventServicer(events), grpc_server)

    def draining() -> None:
        servicer.drain()
        events.close()

    await server.serve(
        "prefill worker", config.listen, SERVICE_NAMES, register,
        on_stop, stop=stop, ready_file=ready_file, endpoints=endpoints, on_draining=draining,
        interceptors=server_interceptors(config.internal_token),
    )
