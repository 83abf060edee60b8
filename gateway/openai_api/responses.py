"""OpenAI response bodies: whole responses, streaming chunks (SSE `data:` payloads) and usage, for
/v1/completions ("text_completion") and /v1/chat/completions ("chat.completion[.chunk]").

A ResponseBuilder is made per request; it only formats (its one piece of state is the completions
logprobs text_offset, which runs over the whole output)."""
from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from gateway.openai_api.json_types import JsonObject

DONE_EVENT = b"data: [DONE]\n\n"


class TopLogprobLike(Protocol):
    token_id: int
    logprob: float


class TokenLogprobLike(Protocol):
    """gateway_pb2.TokenLogprob or anything shaped like it."""

    token_id: int
    logprob: float | None  # None: an echoed prompt's first token (gateway.openai_api.echo.Unscored)
    top: Sequence[TopLogprobLike] | None


# What pdserve knows of OpenAI's completion_tokens_details: its models have no reasoning channel and it does not
# take predicted outputs (`prediction`), so these counts are known to be 0.
COMPLETION_TOKENS_DETAILS = {"reasoning_tokens": 0, "accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> JsonObject:
    """OpenAI's usage object; prompt_tokens_details.cached_tokens: prompt tokens served from the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens},
            "completion_tokens_details": dict(COMPLETION_TOKENS_DETAILS)}


def sse(payload: JsonObject) -> bytes:
    """One server-sent event carrying a JSON object."""
    return b"data: " + json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


@dataclass
class ResponseBuilder:
    """request_id: the x-request-id; logprobs: alternatives per token (None: no logprobs in the answer);
    token_text(id) -> the token's text."""

    request_id: str
    model: str
    created: int
    chat: bool
    logprobs: int | None = None
    token_text: Callable[[int], str] = str
    index: int = 0  # the choice this builder formats (n > 1: one builder per choice)
    _text_offset: int = 0

    @property
    def id(self) -> str:
        return ("chatcmpl-" if self.chat else "cmpl-") + self.request_id

    def _envelope(self, stream: bool) -> JsonObject:
        kind = ("chat.completion.chunk" if stream else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    # --- logprobs -------------------------------------------------------------------------------------
    def _chat_entry(self, token_id: int, logprob: float) -> JsonObject:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    def logprobs_block(self, logprobs: Sequence[TokenLogprobLike]) -> JsonObject | None:
        """The choice's logprobs for these tokens (None when not asked for). Completions' text_offset
        counts the characters of the token texts since the start of the output."""
        if self.logprobs is None:
            return None
        count = self.logprobs
        if self.chat:
            return {"content": [{**self._chat_entry(item.token_id, item.logprob),
                                 "top_logprobs": [self._chat_entry(top.token_id, top.logprob) for top in list(item.top)[:count]]}
                                for item in logprobs], "refusal": None}
        tokens = [self.token_text(item.token_id) for item in logprobs]
        offsets = []
        for token in tokens:
            offsets.append(self._text_offset)
            self._text_offset += len(token)
        return {"tokens": tokens, "token_logprobs": [item.logprob for item in logprobs],
                "top_logprobs": [None if item.top is None else  # an echoed prompt's first token
                                 {self.token_text(top.token_id): top.logprob for top in list(item.top)[:count]}
                                 for item in logprobs],
                "text_offset": offsets}

    # --- bodies ---------------------------------------------------------------------------------------
    def _choice(self, text: str, logprobs: Sequence[TokenLogprobLike], finish_reason: str | None,
                stream: bool, first: bool = False) -> JsonObject:
        choice: JsonObject = {"index": self.index}
        if self.chat and stream:
            choice["delta"] = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        elif self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice["logprobs"] = self.logprobs_block(logprobs)
        choice["finish_reason"] = finish_reason
        return choice

    def response(self, text: str, logprobs: Sequence[TokenLogprobLike], finish_reason: str,
                 prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> JsonObject:
        """The whole (non-streaming) response."""
        return self.responses([self.choice(text, logprobs, finish_reason)], prompt_tokens, completion_tokens,
                              cached_tokens)

    def choice(self, text: str, logprobs: Sequence[TokenLogprobLike], finish_reason: str) -> JsonObject:
        """This builder's choice of a whole (non-streaming) response."""
        return self._choice(text, logprobs, finish_reason, False)

    def responses(self, choices: list[JsonObject], prompt_tokens: int, completion_tokens: int,
                  cached_tokens: int = 0) -> JsonObject:
        """The whole response with these choices (n > 1: each from its own builder); completion_tokens over all."""
        return {**self._envelope(False), "choices": choices,
                "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}

    def chunk(self, text: str, logprobs: Sequence[TokenLogprobLike] = (), finish_reason: str | None = None,
              first: bool = False, include_usage: bool = False) -> JsonObject:
        """One streaming chunk (first: the chat chunk that carries the assistant role); with include_usage
        every chunk has "usage": null, as OpenAI sends it."""
        body = {**self._envelope(True), "choices": [self._choice(text, logprobs, finish_reason, True, first)]}
        if include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> JsonObject:
        """The last chunk of a stream with stream_options.include_usage: no choices, the usage."""
        return {**self._envelope(True), "choices": [], "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}
