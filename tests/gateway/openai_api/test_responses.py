"""OpenAI response bodies: completion and chat shapes, streaming chunks, usage, logprobs formats."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from gateway.openai_api.responses import ResponseBuilder, sse, usage


@dataclass
class Top:
    token_id: int
    logprob: float


@dataclass
class Logprob:
    token_id: int
    logprob: float
    top: list[Top] = field(default_factory=list)


TEXTS = {5: "ab", 6: "c", 7: "zz"}


def _builder(chat: bool, logprobs: int | None = None) -> ResponseBuilder:
    return ResponseBuilder("rid", "tiny", 123, chat, logprobs, TEXTS.__getitem__)


def test_completion_response_and_usage():
    """text_completion with the text, finish_reason and usage (total = prompt + completion)."""
    body = _builder(False).response("hello", [], "length", 4, 2, cached_tokens=3)
    assert body["id"] == "cmpl-rid" and body["object"] == "text_completion" and body["model"] == "tiny"
    assert body["choices"] == [{"index": 0, "text": "hello", "logprobs": None, "finish_reason": "length"}]
    assert body["usage"] == usage(4, 2, 3) == {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6,
                                               "prompt_tokens_details": {"cached_tokens": 3}}


def test_chat_response_and_chunks():
    """chat.completion carries a message; the stream's first chunk carries the role, later ones content
    deltas, the last an empty delta with finish_reason; include_usage adds usage null, then a usage chunk."""
    builder = _builder(True)
    assert builder.response("hi", [], "stop", 1, 1)["choices"][0]["message"] == {"role": "assistant", "content": "hi"}
    first = builder.chunk("", first=True, include_usage=True)
    assert first["object"] == "chat.completion.chunk" and first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert first["usage"] is None
    assert builder.chunk("x")["choices"][0]["delta"] == {"content": "x"} and "usage" not in builder.chunk("x")
    end = builder.chunk("", finish_reason="stop")
    assert end["choices"][0]["delta"] == {} and end["choices"][0]["finish_reason"] == "stop"
    last = builder.usage_chunk(3, 4, 2)
    assert last["choices"] == [] and last["usage"]["total_tokens"] == 7
    assert last["usage"]["prompt_tokens_details"] == {"cached_tokens": 2}


def test_completion_logprobs_offsets_run_over_chunks():
    """Completions logprobs: tokens, token_logprobs, top_logprobs cut to the asked count, text_offset
    continuing across chunks."""
    builder = _builder(False, logprobs=1)
    first = builder.chunk("ab", [Logprob(5, -0.1, [Top(5, -0.1), Top(6, -2.0)])])["choices"][0]["logprobs"]
    assert first == {"tokens": ["ab"], "token_logprobs": [-0.1], "top_logprobs": [{"ab": -0.1}], "text_offset": [0]}
    second = builder.chunk("czz", [Logprob(6, -0.2), Logprob(7, -0.3)])["choices"][0]["logprobs"]
    assert second["text_offset"] == [2, 3] and second["tokens"] == ["c", "zz"]


def test_chat_logprobs_format():
    """Chat logprobs: content entries with token, logprob, bytes and top_logprobs (0 asked: none)."""
    content = _builder(True, logprobs=0).response("ab", [Logprob(5, -0.5, [Top(5, -0.5)])], "stop", 1, 1)
    entry = content["choices"][0]["logprobs"]["content"][0]
    assert entry == {"token": "ab", "logprob": -0.5, "bytes": [97, 98], "top_logprobs": []}


def test_sse_framing():
    """One event: `data: <json>` and a blank line; non-ASCII text is kept as UTF-8."""
    event = sse({"text": "é"})
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    assert json.loads(event[6:].decode()) == {"text": "é"}
