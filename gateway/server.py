"""The gateway process: the public pdserve.v1 GatewayService, health that follows the workers, reflection."""
from __future__ import annotations

import asyncio
import logging
import ssl
from pathlib import Path

import grpc
from aiohttp import web
from grpc_health.v1._async import HealthServicer

from gateway.config import GatewayConfig
from gateway.http_server import HttpFront, start_http
from gateway.model_info import ModelFacts
from gateway.openai_api.chat_template import ChatTemplate
from gateway.service import GatewayService
from gateway.servicer import SERVICE_NAME, GatewayServicer, add_gateway_to_server
from gateway.tokenize_pool import TokenizePool, TokenizePoolConfig
from gateway.tokenizer import TextTokenizer
from gateway.workers import WorkerPool
from rpc import server
from rpc.interceptors import server_interceptors

logger = logging.getLogger(__name__)
HEALTH_EXEMPT = ("/grpc.health.v1.Health/",)  # probes need no API key; everything else does when keys are set


def _credentials(config: GatewayConfig) -> grpc.ServerCredentials | None:
    """TLS when a certificate and key are configured, plaintext otherwise."""
    if config.tls_cert is None or config.tls_key is None:
        return None
    return grpc.ssl_server_credentials([(Path(config.tls_key).read_bytes(), Path(config.tls_cert).read_bytes())])


def _ssl_context(config: GatewayConfig) -> ssl.SSLContext | None:
    """The HTTP front's TLS, from the same certificate and key as the gRPC port."""
    if config.tls_cert is None or config.tls_key is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(config.tls_cert, config.tls_key)
    return context


async def serve(config: GatewayConfig, stop: asyncio.Event | None = None, ready_file: str | None = None) -> None:
    """Runs until SIGTERM / SIGINT (or `stop`). Health is SERVING while at least one prefill and one decode worker answer."""
    facts = ModelFacts.from_dir(config.model_dir)
    tokenizer = TextTokenizer.from_model_dir(config.model_dir)
    if tokenizer is None:
        logger.warning("%s has no tokenizer.json: only token-id requests will be accepted", config.model_dir)
    tokenize = None
    if tokenizer is not None:
        tokenize = TokenizePool(tokenizer, Path(config.model_dir, "tokenizer.json"),
                                TokenizePoolConfig(config.tokenize_inline_chars, config.tokenize_processes))
        await tokenize.warm_up()
    healths: list[HealthServicer] = []
    tasks: set[asyncio.Task[None]] = set()

    def on_health(healthy: bool) -> None:  # SERVING while a prefill and a decode worker answer
        logger.info("%s: health %s", "workers reachable" if healthy else "no prefill or no decode worker reachable",
                    "SERVING" if healthy else "NOT_SERVING")
        for health in healths:
            task = asyncio.get_running_loop().create_task(server.set_serving(health, [SERVICE_NAME], healthy))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    pool = WorkerPool(config, on_health)
    service = GatewayService(config, facts, tokenizer, pool, tokenize)

    def register(grpc_server: grpc.aio.Server) -> None:
        add_gateway_to_server(GatewayServicer(service), grpc_server)

    endpoints: dict[str, str] = {}
    runners: list[web.BaseRunner] = []

    async def on_started(health: HealthServicer, address: str) -> None:
        healths.append(health)
        pool.start()
        logger.info("gateway on %s (%s, %s): model %s, %d prefill, %d decode worker(s), %s transport",
                    address, "TLS" if config.tls_cert else "plaintext", "API keys" if config.api_keys else "no auth",
                    facts.name, len(config.prefill), len(config.decode), config.transport)
        if config.http_listen:  # the OpenAI API, /health and /metrics, on this same event loop
            front = HttpFront(service, ChatTemplate.from_model_dir(config.model_dir), lambda: pool.healthy,
                              api_keys=config.api_keys)
            runner, endpoints["http"] = await start_http(front, config.http_listen, config.max_request_bytes,
                                                         _ssl_context(config))
            runners.append(runner)

    async def on_stop() -> None:
        for runner in runners:
            await runner.cleanup()
        await service.shutdown(config.cleanup_timeout_s)
        await pool.close()
        if tokenize is not None:
            tokenize.close()

    await server.serve("gateway", config.listen, [SERVICE_NAME], register, on_stop, stop=stop,
                       ready_file=ready_file, on_started=on_started, serving_when_started=False,
                       interceptors=server_interceptors(*config.api_keys, exempt=HEALTH_EXEMPT),
                       options=[("grpc.max_receive_message_length", config.max_request_bytes)],  # refused before parsing
                       credentials=_credentials(config), endpoints=endpoints)
