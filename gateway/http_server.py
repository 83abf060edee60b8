"""The gateway's HTTP front, on the same event loop as its gRPC server: the OpenAI-compatible API
(POST /v1/completions, POST /v1/chat/completions, GET /v1/models), GET /health and GET /metrics.

Library: aiohttp's low-level server (aiohttp.web.Server): it runs as coroutines on the loop that is
already running (uvloop in the gateway process), so no second loop or thread sits between HTTP and the
gRPC calls to the workers; it parses HTTP with llhttp (C); its StreamResponse writes server-sent events
straight to the transport; and with handler_cancellation it cancels a handler whose client disconnected,
which is how an abandoned request gets aborted. The low-level server skips aiohttp.web.Application's
router and middleware machinery: there are five routes, matched by one dict lookup."""
from __future__ import annotations

import asyncio
import hmac
import logging
import ssl
import time
from collections.abc import Awaitable, Callable
from aiohttp import web
from aiohttp.abc import AbstractStreamWriter
from aiohttp.http_parser import RawRequestMessage
from aiohttp.streams import StreamReader
from aiohttp.web_protocol import RequestHandler
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.http_generate import GenerateHandler, error_response, json_response
from gateway.openai_api.chat_template import ChatTemplate
from gateway.openai_api.errors import OpenAIError
from gateway.service import GatewayService
from rpc.server import MAX_MESSAGE_BYTES

logger = logging.getLogger(__name__)
Handler = Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]


OPEN_PATHS = frozenset({"/health", "/metrics"})  # served without an API key (probes, scrapers)


class HttpFront:
    """Routes requests; `healthy()` says whether every worker is reachable. api_keys: when given, every
    path but OPEN_PATHS needs `Authorization: Bearer <one of them>` (401 otherwise)."""

    def __init__(self, service: GatewayService, template: ChatTemplate, healthy: Callable[[], bool],
                 api_keys: tuple[str, ...] = ()) -> None:
        self._service = service
        self._keys = [f"Bearer {key}".encode() for key in api_keys]
        self._healthy = healthy
        self._created = int(time.time())
        generate = GenerateHandler(service, template)

        async def completions(request: web.BaseRequest) -> web.StreamResponse:
            return await generate(request, chat=False)

        async def chat(request: web.BaseRequest) -> web.StreamResponse:
            return await generate(request, chat=True)

        self._routes: dict[str, dict[str, Handler]] = {
            "/v1/completions": {"POST": completions},
            "/v1/chat/completions": {"POST": chat},
            "/v1/models": {"GET": self._models},
            "/health": {"GET": self._health},
            "/metrics": {"GET": self._metrics},
        }

    def _authorized(self, request: web.BaseRequest) -> bool:
        given = request.headers.get("Authorization", "").encode()
        return any(hmac.compare_digest(given, key) for key in self._keys)

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        if self._keys and request.path not in OPEN_PATHS and not self._authorized(request):
            return error_response(OpenAIError(401, "missing or invalid API key (Authorization: Bearer <key>)",
                                              error_type="authentication_error"))
        methods = self._routes.get(request.path)
        if methods is None:
            return error_response(OpenAIError(404, f"no route {request.path}", error_type="not_found_error"))
        handler = methods.get(request.method)
        if handler is None:
            return error_response(OpenAIError(405, f"{request.path} takes {', '.join(methods)}, not {request.method}"))
        return await handler(request)

    def _model_card(self) -> dict[str, object]:
        facts = self._service.facts
        return {"id": facts.name, "object": "model", "created": self._created, "owned_by": "pdserve",
                "max_model_len": facts.max_context,
                # pdserve extensions (what `pdserve bench --backend openai` needs for random token prompts)
                "vocab_size": facts.vocab_size, "eos_token_ids": list(facts.eos_token_ids)}

    async def _models(self, request: web.BaseRequest) -> web.StreamResponse:
        return json_response({"object": "list", "data": [self._model_card()]})

    async def _health(self, request: web.BaseRequest) -> web.StreamResponse:
        if self._healthy():
            return json_response({"status": "ok"})
        return error_response(OpenAIError(503, "not every worker is reachable", error_type="service_unavailable_error"))

    async def _metrics(self, request: web.BaseRequest) -> web.StreamResponse:
        body = generate_latest(self._service.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def start_http(front: HttpFront, listen: str, max_body_bytes: int = MAX_MESSAGE_BYTES,
                     ssl_context: ssl.SSLContext | None = None) -> tuple[web.BaseRunner, str]:
    """Serves front on listen (host:port; port 0 picks one), HTTPS with ssl_context; returns the runner
    (await runner.cleanup() to stop) and the bound host:port. Bodies over max_body_bytes get 413."""
    host, port = listen.rsplit(":", 1)
    loop = asyncio.get_running_loop()

    def make_request(message: RawRequestMessage, payload: StreamReader, protocol: RequestHandler,
                     writer: AbstractStreamWriter, task: asyncio.Task[None]) -> web.BaseRequest:
        """Bodies up to the gRPC API's message limit (long prompts), not aiohttp's default 1 MiB."""
        return web.BaseRequest(message, payload, protocol, writer, task, loop, client_max_size=max_body_bytes)

    server = web.Server(front.handle, request_factory=make_request, handler_cancellation=True, access_log=None)
    runner = web.ServerRunner(server, shutdown_timeout=2.0)
    await runner.setup()
    site = web.TCPSite(runner, host.strip("[]") or None, int(port), ssl_context=ssl_context)
    await site.start()
    bound = runner.addresses[0][1]
    advertised = "127.0.0.1" if host in ("", "0.0.0.0", "[::]", "::") else host
    logger.info("HTTP (OpenAI API, /health, /metrics) on %s:%d", advertised, bound)
    return runner, f"{advertised}:{bound}"
