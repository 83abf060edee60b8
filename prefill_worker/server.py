"""The prefill worker process: PrefillService behind gRPC (Prefill + health + reflection)."""
from __future__ import annotations

import asyncio
import logging

import grpc

from pdserve import serving
from pdserve.interceptors import server_interceptors
from pdserve.v1 import worker_pb2, worker_pb2_grpc
from prefill_worker.config import PrefillWorkerConfig
from prefill_worker.service import PrefillService
from prefill_worker.servicer import PrefillServicer

logger = logging.getLogger(__name__)
SERVICE_NAMES = (worker_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name,)


async def serve(config: PrefillWorkerConfig, stop: asyncio.Event | None = None, ready_file: str | None = None) -> None:
    """Runs until SIGTERM / SIGINT (or `stop`); queued prompts are refused on the way out."""
    service = PrefillService(config)
    await service.start()
    server = grpc.aio.server(options=serving.SERVER_OPTIONS, interceptors=server_interceptors(config.internal_token))
    worker_pb2_grpc.add_PrefillServicer_to_server(PrefillServicer(service), server)
    health = serving.add_health_and_reflection(server, SERVICE_NAMES)
    port = server.add_insecure_port(config.listen)
    address = serving.bound_address(config.listen, port)
    await server.start()
    await serving.set_serving(health, SERVICE_NAMES, True)
    logger.info("prefill worker serving on %s (tp=%d)", address, config.tp_size)
    serving.write_ready_file(ready_file, address)
    try:
        await serving.wait_for_stop_signal(stop)
    finally:
        logger.info("prefill worker stopping")
        await health.enter_graceful_shutdown()
        await server.stop(grace=2.0)
        await service.stop()
        logger.info("prefill worker stopped")
