"""POST /v1/completions and /v1/chat/completions: parse, submit to the GatewayService (the same path as
the gRPC Generate), and answer with one JSON body or a server-sent-event stream.

A client that goes away (aiohttp cancels the handler when the connection drops, or a write fails)
cancels the run, which aborts the request on every worker and frees its pages."""
from __future__ import annotations

import json
import logging
import time
import uuid
from functools import lru_cache
from typing import Any

from aiohttp import web

from gateway.openai_api.chat_template import ChatTemplate
from gateway.openai_api.convert import chat_prompt_ids, to_generate_request
from gateway.openai_api.errors import OpenAIError, from_status
from gateway.openai_api.params import OpenAIRequest, parse_request
from gateway.openai_api.responses import DONE_EVENT, ResponseBuilder, sse
from gateway.orchestrator import ErrorEvent, FinishEvent, RequestRun, TokensEvent
from gateway.service import GatewayService
from gateway.requests import MAX_REQUEST_ID_LENGTH
from rpc.logging_setup import REQUEST_ID_KEY, bind_request_id
from rpc.status import status_for

logger = logging.getLogger(__name__)
REQUEST_ID_HEADER = REQUEST_ID_KEY
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "Connection": "keep-alive"}


def json_response(body: dict[str, Any], status: int = 200, request_id: str = "") -> web.Response:
    headers = {REQUEST_ID_HEADER: request_id} if request_id else None
    return web.Response(body=json.dumps(body, ensure_ascii=False).encode(), status=status,
                        content_type="application/json", headers=headers)


def error_response(error: OpenAIError, request_id: str = "") -> web.Response:
    return json_response(error.body(), error.status, request_id)


def request_id_from(request: web.BaseRequest) -> str:
    """The client's x-request-id (validated), else a new one."""
    value = request.headers.get(REQUEST_ID_HEADER, "").strip()
    if not value:
        return uuid.uuid4().hex
    if len(value) > MAX_REQUEST_ID_LENGTH or not value.isprintable():
        raise OpenAIError(400, f"{REQUEST_ID_HEADER}: must be printable and at most {MAX_REQUEST_ID_LENGTH} characters",
                          param=REQUEST_ID_HEADER)
    return value


class GenerateHandler:
    def __init__(self, service: GatewayService, template: ChatTemplate) -> None:
        self._service = service
        self._template = template
        tokenizer = service.tokenizer
        self._token_text = lru_cache(maxsize=65536)(
            (lambda token: tokenizer.decode([token], skip_special_tokens=False)) if tokenizer else str)

    async def __call__(self, request: web.BaseRequest, chat: bool) -> web.StreamResponse:
        arrival = time.perf_counter()
        metrics, request_id, parsed = self._service.metrics, "", None
        try:
            request_id = request_id_from(request)
            bind_request_id(request_id)
            parsed = await self._parse(request, chat)
            prompt_ids = chat_prompt_ids(parsed, self._template, self._service.tokenizer) if chat else None
            run = await self._service.submit(to_generate_request(parsed, request_id, prompt_ids), False, arrival, None)
        except OpenAIError as error:
            metrics.count("http", "error", str(error.status))
            return error_response(error, request_id)
        except Exception as error:  # noqa: BLE001 - GatewayService raises ServiceErrors; all become statuses
            failure = self._failure(error, parsed)
            metrics.count("http", "error", str(failure.status))
            return error_response(failure, request_id)
        if parsed.user:
            logger.info("request %s from user %r", request_id, parsed.user)
        builder = ResponseBuilder(request_id, self._service.facts.name, int(time.time()), chat, parsed.logprobs,
                                  self._token_text)
        outcome = ["abort", "499"]  # (final status, HTTP code) for the metrics; 499: the client went away
        try:
            if parsed.stream:
                return await self._stream(request, run, builder, parsed, outcome)
            return await self._collect(run, builder, parsed, outcome)
        finally:
            run.cancel()
            metrics.count("http", *outcome)

    async def _parse(self, request: web.BaseRequest, chat: bool) -> OpenAIRequest:
        try:
            body = json.loads(await request.read())
        except web.HTTPRequestEntityTooLarge as error:
            raise OpenAIError(413, f"body: larger than {request.client_max_size} bytes", param="body") from error
        except (ValueError, UnicodeDecodeError) as error:
            raise OpenAIError(400, f"body: not valid JSON ({error})", param="body") from error
        parsed = parse_request(body, chat)
        if parsed.model != self._service.facts.name:
            raise OpenAIError(404, f"model: {parsed.model!r} does not exist; this server serves "
                              f"{self._service.facts.name!r}", param="model", code="model_not_found")
        return parsed

    @staticmethod
    def _failure(error: BaseException, parsed: OpenAIRequest | None) -> OpenAIError:
        code, message = status_for(error)
        if parsed is None:
            return from_status(code, message)
        return from_status(code, message, parsed.prompt_param, parsed.logprobs_param)

    async def _collect(self, run: RequestRun, builder: ResponseBuilder, parsed: OpenAIRequest,
                       outcome: list[str]) -> web.Response:
        texts: list[str] = []
        logprobs: list[Any] = []
        while True:
            event = await run.events.get()
            if isinstance(event, TokensEvent):
                texts.append(event.text)
                logprobs.extend(event.logprobs)
            elif isinstance(event, FinishEvent):
                outcome[:] = [event.reason, "200"]
                body = builder.response("".join(texts), logprobs, event.reason, event.prompt_tokens,
                                        event.completion_tokens, event.cached_tokens)
                return json_response(body, 200, builder.request_id)
            elif isinstance(event, ErrorEvent):
                error = from_status(event.status.code, event.status.details, parsed.prompt_param, parsed.logprobs_param)
                outcome[:] = ["error", str(error.status)]
                return error_response(error, builder.request_id)

    async def _stream(self, request: web.BaseRequest, run: RequestRun, builder: ResponseBuilder,
                      parsed: OpenAIRequest, outcome: list[str]) -> web.StreamResponse:
        first = await run.events.get()
        if isinstance(first, ErrorEvent):  # nothing sent yet: a plain error response with its status
            error = from_status(first.status.code, first.status.details, parsed.prompt_param, parsed.logprobs_param)
            outcome[:] = ["error", str(error.status)]
            return error_response(error, builder.request_id)
        response = web.StreamResponse(status=200, headers={**SSE_HEADERS, REQUEST_ID_HEADER: builder.request_id})
        await response.prepare(request)
        usage = parsed.include_usage
        if parsed.chat:
            await response.write(sse(builder.chunk("", first=True, include_usage=usage)))
        pending: list[TokensEvent | FinishEvent | ErrorEvent] = [first]
        try:
            while True:
                while not run.events.empty():  # the writer fell behind: send what piled up as one chunk
                    pending.append(run.events.get_nowait())
                tokens = []
                while pending and isinstance(pending[0], TokensEvent):
                    tokens.append(pending.pop(0))
                text = "".join(item.text for item in tokens)
                logprobs = [logprob for item in tokens for logprob in item.logprobs]
                if text or logprobs:
                    await response.write(sse(builder.chunk(text, logprobs, include_usage=usage)))
                if pending:
                    await self._stream_end(response, pending[0], builder, parsed, outcome)  # type: ignore[arg-type]
                    break
                pending.append(await run.events.get())
            await response.write(DONE_EVENT)
            await response.write_eof()
        except ConnectionResetError:
            logger.info("client of %s went away mid-stream; aborting it", builder.request_id)
        return response

    @staticmethod
    async def _stream_end(response: web.StreamResponse, event: FinishEvent | ErrorEvent, builder: ResponseBuilder,
                          parsed: OpenAIRequest, outcome: list[str]) -> None:
        """The finish chunk (and usage), or an error event after the stream started."""
        if isinstance(event, FinishEvent):
            await response.write(sse(builder.chunk("", finish_reason=event.reason, include_usage=parsed.include_usage)))
            if parsed.include_usage:
                await response.write(sse(builder.usage_chunk(event.prompt_tokens, event.completion_tokens,
                                                                  event.cached_tokens)))
            outcome[:] = [event.reason, "200"]
            return
        error = from_status(event.status.code, event.status.details, parsed.prompt_param, parsed.logprobs_param)
        await response.write(sse(error.body()))
        outcome[:] = ["error", str(error.status)]
