"""The gateway process: the public pdserve.v1.Gateway service, health that follows the workers, reflection."""
from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import grpc

from gateway.config import GatewayConfig
from gateway.model_info import ModelFacts
from gateway.service import GatewayService
from gateway.servicer import SERVICE_NAME, GatewayServicer, add_gateway_to_server
from gateway.tokenize_pool import TokenizePool, TokenizePoolConfig
from gateway.tokenizer import TextTokenizer
from gateway.workers import WorkerPool
from pdserve import serving
from pdserve.interceptors import server_interceptors

logger = logging.getLogger(__name__)
HEALTH_EXEMPT = ("/grpc.health.v1.Health/",)  # probes need no API key; everything else does when keys are set


def _add_port(server: grpc.aio.Server, config: GatewayConfig) -> int:
    """TLS when a certificate and key are configured, plaintext otherwise."""
    if config.tls_cert is None or config.tls_key is None:
        return server.add_insecure_port(config.listen)
    credentials = grpc.ssl_server_credentials([(Path(config.tls_key).read_bytes(), Path(config.tls_cert).read_bytes())])
    return server.add_secure_port(config.listen, credentials)


async def serve(config: GatewayConfig, stop: asyncio.Event | None = None, ready_file: str | None = None) -> None:
    """Runs until SIGTERM / SIGINT (or `stop`). Health is SERVING only while every worker answers."""
    facts = ModelFacts.from_dir(config.model_dir)
    tokenizer = TextTokenizer.from_model_dir(config.model_dir)
    if tokenizer is None:
        logger.warning("%s has no tokenizer.json: only token-id requests will be accepted", config.model_dir)
    tokenize = None
    if tokenizer is not None:
        tokenize = TokenizePool(tokenizer, Path(config.model_dir, "tokenizer.json"),
                                TokenizePoolConfig(config.tokenize_inline_chars, config.tokenize_processes))
        await tokenize.warm_up()
    options = [option for option in serving.SERVER_OPTIONS if option[0] != "grpc.max_receive_message_length"]
    options.append(("grpc.max_receive_message_length", config.max_request_bytes))  # refused before parsing
    server = grpc.aio.server(options=options, interceptors=server_interceptors(*config.api_keys, exempt=HEALTH_EXEMPT))
    health = serving.add_health_and_reflection(server, [SERVICE_NAME])
    await serving.set_serving(health, [SERVICE_NAME], False)  # until the first poll finds every worker
    tasks: set[asyncio.Task[None]] = set()

    def on_health(healthy: bool) -> None:
        logger.info("workers %s: health %s", "all reachable" if healthy else "not all reachable",
                    "SERVING" if healthy else "NOT_SERVING")
        task = asyncio.get_running_loop().create_task(serving.set_serving(health, [SERVICE_NAME], healthy))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    pool = WorkerPool(config, on_health)
    service = GatewayService(config, facts, tokenizer, pool, tokenize)
    add_gateway_to_server(GatewayServicer(service), server)
    port = _add_port(server, config)
    address = serving.bound_address(config.listen, port)
    await server.start()
    pool.start()
    logger.info("gateway serving on %s (%s, %s): model %s, %d prefill, %d decode worker(s), %s transport",
                address, "TLS" if config.tls_cert else "plaintext", "API keys" if config.api_keys else "no auth",
                facts.name, len(config.prefill), len(config.decode), config.transport)
    serving.write_ready_file(ready_file, address)
    try:
        await serving.wait_for_stop_signal(stop)
    finally:
        logger.info("gateway stopping")
        await health.enter_graceful_shutdown()
        await server.stop(grace=2.0)
        await service.shutdown(config.cleanup_timeout_s)
        await pool.close()
        if tokenize is not None:
            tokenize.close()
        logger.info("gateway stopped")
