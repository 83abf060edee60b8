"""The gateway process: the public pdserve.v1 GatewayService, health that follows the workers, reflection."""
from __future__ import annotations

import asyncio
import logging

import grpc
from aiohttp import web
from grpc_health.v1._async import HealthServicer

from gateway.config import GatewayConfig
from gateway.http_server import HttpFront, start_http
from gateway.model_info import ModelFacts
from gateway.openai_api.chat_template import ChatTemplate
from gateway.service import GatewayService
from gateway.servicer import SERVICE_NAME, GatewayServicer, add_gateway_to_server
from gateway.tokenizer import TextTokenizer
from gateway.workers import WorkerPool
from rpc import server

logger = logging.getLogger(__name__)


async def serve(config: GatewayConfig, stop: asyncio.Event | None = None, ready_file: str | None = None) -> None:
    """Runs until SIGTERM / SIGINT (or `stop`). Health is SERVING only while every worker answers."""
    facts = ModelFacts.from_dir(config.model_dir)
    tokenizer = TextTokenizer.from_model_dir(config.model_dir)
    if tokenizer is None:
        logger.warning("%s has no tokenizer.json: only token-id requests will be accepted", config.model_dir)
    healths: list[HealthServicer] = []
    tasks: set[asyncio.Task[None]] = set()

    def on_health(healthy: bool) -> None:  # health follows the workers: NOT_SERVING until all answer
        logger.info("workers %s: health %s", "all reachable" if healthy else "not all reachable",
                    "SERVING" if healthy else "NOT_SERVING")
        for health in healths:
            task = asyncio.get_running_loop().create_task(server.set_serving(health, [SERVICE_NAME], healthy))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    pool = WorkerPool(config, on_health)
    service = GatewayService(config, facts, tokenizer, pool)

    def register(grpc_server: grpc.aio.Server) -> None:
        add_gateway_to_server(GatewayServicer(service), grpc_server)

    endpoints: dict[str, str] = {}
    runners: list[web.BaseRunner] = []

    async def on_started(health: HealthServicer, address: str) -> None:
        healths.append(health)
        pool.start()
        logger.info("gateway on %s: model %s, %d prefill, %d decode worker(s), %s transport",
                    address, facts.name, len(config.prefill), len(config.decode), config.transport)
        if config.http_listen:  # the OpenAI API, /health and /metrics, on this same event loop
            front = HttpFront(service, ChatTemplate.from_model_dir(config.model_dir), lambda: pool.healthy)
            runner, endpoints["http"] = await start_http(front, config.http_listen)
            runners.append(runner)

    async def on_stop() -> None:
        for runner in runners:
            await runner.cleanup()
        await service.shutdown(config.cleanup_timeout_s)
        await pool.close()

    await server.serve("gateway", config.listen, [SERVICE_NAME], register, on_stop, stop=stop,
                       ready_file=ready_file, on_started=on_started, serving_when_started=False, endpoints=endpoints)
