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

from aiohttp import web

from gateway.http_choices import Choices
from gateway.openai_api.chat_template import ChatTemplate
from gateway.openai_api.convert import chat_prompt_ids, choice_requests
from gateway.openai_api.echo import ChoiceView, prompt_logprobs_field
from gateway.openai_api.errors import OpenAIError, from_status
from gateway.openai_api.json_types import JsonObject
from gateway.openai_api.params import OpenAIRequest, parse_request
from gateway.openai_api.responses import DONE_EVENT, ResponseBuilder, TokenLogprobLike, sse
from gateway.orchestrator import ErrorEvent, FinishEvent, TokensEvent
from gateway.service import GatewayService
from gateway.requests import MAX_REQUEST_ID_LENGTH
from rpc.logging_setup import REQUEST_ID_KEY, bind_request_id
from rpc.status import status_for
from rpc.v1 import logprobs_pb2

logger = logging.getLogger(__name__)
REQUEST_ID_HEADER = REQUEST_ID_KEY
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "Connection": "keep-alive"}


def json_response(body: JsonObject, status: int = 200, request_id: str = "") -> web.Response:
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
            choices = await Choices.submit(self._service, choice_requests(parsed, request_id, prompt_ids), arrival)
        except OpenAIError as error:
            metrics.count("http", "error", str(error.status))
            return error_response(error, request_id)
        except Exception as error:  # noqa: BLE001 - GatewayService raises ServiceErrors; all become statuses
            failure = self._failure(error, parsed)
            metrics.count("http", "error", str(failure.status))
            return error_response(failure, request_id)
        if parsed.user:
            logger.info("request %s from user %r", request_id, parsed.user)
        created = int(time.time())
        builders = [ResponseBuilder(request_id, self._service.facts.name, created, chat, parsed.logprobs,
                                    self._token_text, index) for index in range(parsed.n)]
        shows_prompt = parsed.echo or parsed.prompt_logprobs is not None
        prompt_ids = choices.runs[0].job.prompt_ids if shows_prompt else ()
        views = [self._view(parsed, prompt_ids) for _ in builders]
        outcome = ["abort", "499"]  # (final status, HTTP code) for the metrics; 499: the client went away
        try:
            if parsed.stream:
                return await self._stream(request, choices, builders, views, parsed, outcome)
            return await self._collect(choices, builders, views, parsed, outcome)
        finally:
            choices.cancel()
            metrics.count("http", *outcome)

    def _view(self, parsed: OpenAIRequest, prompt_ids: tuple[int, ...]) -> ChoiceView:
        echo_text = None
        if parsed.echo:
            tokenizer = self._service.tokenizer
            echo_text = parsed.prompt_text if parsed.prompt_text is not None else (
                tokenizer.decode(list(prompt_ids), skip_special_tokens=False) if tokenizer else "")
        return ChoiceView(echo_text, prompt_ids, parsed.logprobs is not None, keep_completion=parsed.max_tokens != 0)

    def _with_prompt_logprobs(self, body: JsonObject, parsed: OpenAIRequest, prompt_ids: tuple[int, ...],
                              prompt_logprobs: list[logprobs_pb2.TokenLogprob] | None) -> JsonObject:
        """vLLM's prompt_logprobs: on each choice (completions) or on the response (chat), when asked."""
        if parsed.prompt_logprobs is None or prompt_logprobs is None:
            return body
        entries = prompt_logprobs_field(prompt_ids, prompt_logprobs, parsed.prompt_logprobs, self._token_text)
        if parsed.chat:
            body["prompt_logprobs"] = entries
        else:
            for choice in body["choices"]:
                choice["prompt_logprobs"] = entries
        return body

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
        return from_status(code, message, parsed.prompt_param, parsed.logprobs_param, parsed.structured_param)

    async def _collect(self, choices: Choices, builders: list[ResponseBuilder], views: list[ChoiceView],
                       parsed: OpenAIRequest, outcome: list[str]) -> web.Response:
        texts: list[list[str]] = [[] for _ in builders]
        logprobs: list[list[TokenLogprobLike]] = [[] for _ in builders]
        finishes: dict[int, FinishEvent] = {}
        scored: list[logprobs_pb2.TokenLogprob] | None = None
        while len(finishes) < len(builders):
            index, event = await choices.get()
            if isinstance(event, TokensEvent):
                text, shown = views[index].take(event.text, event.logprobs, event.prompt_logprobs)
                texts[index].append(text)
                logprobs[index].extend(shown)
                scored = list(event.prompt_logprobs) if scored is None else scored
            elif isinstance(event, FinishEvent):
                finishes[index] = event
            elif isinstance(event, ErrorEvent):
                error = from_status(event.status.code, event.status.details, parsed.prompt_param, parsed.logprobs_param)
                outcome[:] = ["error", str(error.status)]
                return error_response(error, builders[0].request_id)
        bodies = [builder.choice("".join(texts[i]), logprobs[i], finishes[i].reason) for i, builder in enumerate(builders)]
        outcome[:] = [finishes[len(builders) - 1].reason, "200"]
        completion = sum(views[i].completion_tokens(f.completion_tokens) for i, f in finishes.items())
        body = builders[0].responses(bodies, finishes[0].prompt_tokens, completion, finishes[0].cached_tokens)
        body = self._with_prompt_logprobs(body, parsed, views[0].prompt_ids, scored)
        return json_response(body, 200, builders[0].request_id)

    async def _stream(self, request: web.BaseRequest, choices: Choices, builders: list[ResponseBuilder],
                      views: list[ChoiceView], parsed: OpenAIRequest, outcome: list[str]) -> web.StreamResponse:
        first = await choices.get()
        if isinstance(first[1], ErrorEvent):  # nothing sent yet: a plain error response with its status
            error = from_status(first[1].status.code, first[1].status.details, parsed.prompt_param,
                                parsed.logprobs_param)
            outcome[:] = ["error", str(error.status)]
            return error_response(error, builders[0].request_id)
        response = web.StreamResponse(status=200, headers={**SSE_HEADERS, REQUEST_ID_HEADER: builders[0].request_id})
        await response.prepare(request)
        usage = parsed.include_usage
        if parsed.chat:
            for builder in builders:
                await response.write(sse(builder.chunk("", first=True, include_usage=usage)))
        pending: list[tuple[int, TokensEvent | FinishEvent | ErrorEvent]] = [first]
        finishes: dict[int, FinishEvent] = {}
        started: set[int] = set()  # choices whose first token event was sent
        failed = False
        try:
            while True:
                while not choices.empty():  # the writer fell behind: send what piled up, one chunk per choice run
                    pending.append(choices.get_nowait())
                while pending:
                    index, event = pending.pop(0)
                    if isinstance(event, TokensEvent):
                        tokens = [event]
                        while pending and pending[0][0] == index and isinstance(pending[0][1], TokensEvent):
                            tokens.append(pending.pop(0)[1])  # type: ignore[arg-type]
                        shown = [views[index].take(item.text, item.logprobs, item.prompt_logprobs)
                                 for item in tokens]
                        text = "".join(item[0] for item in shown)
                        logprobs = [logprob for item in shown for logprob in item[1]]
                        # a chunk per token event even when its text is held back (an incomplete UTF-8 character,
                        # a possible stop string): clients time tokens by chunks, as vLLM streams them
                        body = builders[index].chunk(text, logprobs, include_usage=usage)
                        if index not in started:
                            body = self._with_prompt_logprobs(body, parsed, views[0].prompt_ids,
                                                              list(tokens[0].prompt_logprobs))
                            started.add(index)
                        await response.write(sse(body))
                        continue
                    if isinstance(event, FinishEvent):
                        finishes[index] = event
                        await response.write(sse(builders[index].chunk("", finish_reason=event.reason,
                                                                       include_usage=usage)))
                        outcome[:] = [event.reason, "200"]
                        continue
                    error = from_status(event.status.code, event.status.details, parsed.prompt_param,
                                        parsed.logprobs_param)
                    await response.write(sse(error.body()))  # a failed choice ends the whole stream
                    outcome[:] = ["error", str(error.status)]
                    failed = True
                    break
                if failed or len(finishes) == len(builders):
                    break
                pending.append(await choices.get())
            if usage and not failed:
                completion = sum(views[i].completion_tokens(event.completion_tokens) for i, event in finishes.items())
                await response.write(sse(builders[0].usage_chunk(finishes[0].prompt_tokens, completion,
                                                                  finishes[0].cached_tokens)))
            await response.write(DONE_EVENT)
            await response.write_eof()
        except ConnectionResetError:
            logger.info("client of %s went away mid-stream; aborting it", builders[0].request_id)
        return response

