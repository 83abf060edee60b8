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
    """text_completion with the text, finish_reason and usage (total = prompt + completion; cached prompt tokens;
    the completion details pdserve knows: no reasoning or predicted-output tokens)."""
    body = _builder(False).response("hello", [], "length", 4, 2, cached_tokens=3)
    assert body["id"] == "cmpl-rid" and body["object"] == "text_completion" and body["model"] == "tiny"
    assert body["choices"] == [{"index": 0, "text": "hello", "logprobs": None, "finish_reason": "length"}]
    assert body["usage"] == usage(4, 2, 3) == {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6,
                                               "prompt_tokens_details": {"cached_tokens": 3},
                                               "completion_tokens_details": {"reasoning_tokens": 0,
                                                                             "accepted_prediction_tokens": 0,
                                                                             "rejected_prediction_tokens": 0}}


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


def test_echoed_prompt_logprobs_in_openai_format():
    """echo + logprobs: the prompt's text first; its first token with a null logprob and null alternatives, the
    others scored, then the generated tokens; with max_tokens 0 the generated token is dropped (0 completion
    tokens); vLLM's prompt_logprobs lists null, then {id: {logprob, rank, decoded_token}} per prompt token."""
    from gateway.openai_api.echo import ChoiceView, prompt_logprobs_field

    builder = _builder(False, logprobs=1)
    prompt = [Logprob(6, -1.5, [Top(5, -0.5), Top(6, -1.5)]), Logprob(7, -3.0, [Top(5, -0.2)])]
    view = ChoiceView("abczz", (5, 6, 7), with_logprobs=True)
    text, shown = view.take("c", [Logprob(6, -0.7, [Top(6, -0.7)])], prompt)
    body = builder.response(text, shown, "length", 3, 1)
    block = body["choices"][0]["logprobs"]
    assert body["choices"][0]["text"] == "abczzc"
    assert block["tokens"] == ["ab", "c", "zz", "c"] and block["token_logprobs"] == [None, -1.5, -3.0, -0.7]
    assert block["top_logprobs"] == [None, {"ab": -0.5}, {"ab": -0.2}, {"c": -0.7}]
    assert block["text_offset"] == [0, 2, 3, 5]
    assert json.loads(json.dumps(body)) == body
    scoring = ChoiceView("abczz", (5, 6, 7), with_logprobs=True, keep_completion=False)
    text, shown = scoring.take("c", [Logprob(6, -0.7)], prompt)
    assert text == "abczz" and [item.token_id for item in shown] == [5, 6, 7] and scoring.completion_tokens(1) == 0
    assert scoring.take("tail", [], []) == ("", [])  # the detokenizer's flush of the dropped token
    field = prompt_logprobs_field((5, 6, 7), prompt, 1, TEXTS.__getitem__)
    assert field == [None, {"5": {"logprob": -0.5, "rank": 1, "decoded_token": "ab"},
                            "6": {"logprob": -1.5, "rank": None, "decoded_token": "c"}},
                     {"5": {"logprob": -0.2, "rank": 1, "decoded_token": "ab"},
                      "7": {"logprob": -3.0, "rank": None, "decoded_token": "zz"}}]
