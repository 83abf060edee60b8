"""OpenAI request bodies -> OpenAIRequest: every supported parameter maps, every refusal is a 400 naming
the parameter."""
from __future__ import annotations

import json

import pytest

from gateway.openai_api.errors import OpenAIError
from gateway.openai_api.params import COMPLETIONS_DEFAULT_MAX_TOKENS, ChatMessage, parse_request


def _param_of(body: dict, chat: bool = False) -> str | None:
    with pytest.raises(OpenAIError) as caught:
        parse_request(body, chat)
    assert caught.value.status == 400
    assert caught.value.message.startswith(f"{caught.value.param}: ")
    return caught.value.param


def test_completion_parameters_map():
    """Every supported completions parameter lands in its field; negative seeds wrap to uint64."""
    parsed = parse_request({"model": "m", "prompt": "hi", "max_tokens": 5, "temperature": 0.5, "top_p": 0.9,
                            "top_k": 7, "min_p": 0.1, "stop": ["a", "b"], "seed": -1, "logprobs": 2,
                            "stream": True, "stream_options": {"include_usage": True}, "user": "u",
                            "ignore_eos": True, "n": 1}, chat=False)
    assert (parsed.prompt_text, parsed.prompt_ids, parsed.max_tokens) == ("hi", None, 5)
    assert (parsed.temperature, parsed.top_p, parsed.top_k, parsed.min_p) == (0.5, 0.9, 7, 0.1)
    assert parsed.stop == ("a", "b") and parsed.seed == 2**64 - 1 and parsed.logprobs == 2
    assert parsed.stream and parsed.include_usage and parsed.user == "u" and parsed.ignore_eos


def test_completion_prompt_forms_and_default_max_tokens():
    """A string, token ids, or a one-element batch of either; max_tokens defaults to OpenAI's 16."""
    assert parse_request({"model": "m", "prompt": [3, 4]}, False).prompt_ids == (3, 4)
    assert parse_request({"model": "m", "prompt": [[5]]}, False).prompt_ids == (5,)
    assert parse_request({"model": "m", "prompt": ["x"]}, False).prompt_text == "x"
    assert parse_request({"model": "m", "prompt": "x"}, False).max_tokens == COMPLETIONS_DEFAULT_MAX_TOKENS


def test_chat_parameters_map():
    """messages with text parts join; max_completion_tokens wins over max_tokens; logprobs + top_logprobs."""
    parsed = parse_request({"model": "m", "messages": [
        {"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                          {"type": "text", "text": "b"}]}],
        "max_tokens": 3, "max_completion_tokens": 9, "logprobs": True, "top_logprobs": 4}, chat=True)
    assert parsed.messages == (ChatMessage("system", "s"), ChatMessage("user", "ab"))
    assert parsed.max_tokens == 9 and parsed.logprobs == 4 and parsed.max_tokens is not None
    assert parse_request({"model": "m", "messages": [{"role": "user", "content": "x"}]}, True).max_tokens is None
    assert parse_request({"model": "m", "messages": [{"role": "user", "content": "x"}], "logprobs": True}, True).logprobs == 0


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x"}, "model"),
    ({"model": "m", "prompt": ""}, "prompt"),
    ({"model": "m", "prompt": ["a", "b"]}, "prompt"),
    ({"model": "m", "prompt": "x", "n": 17}, "n"),
    ({"model": "m", "prompt": "x", "n": 2, "best_of": 3}, "best_of"),
    ({"model": "m", "prompt": "x", "logit_bias": {"a": 1}}, "logit_bias"),
    ({"model": "m", "prompt": "x", "logit_bias": {"3": -101}}, "logit_bias"),
    ({"model": "m", "prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ({"model": "m", "prompt": "x", "frequency_penalty": 2.5}, "frequency_penalty"),
    ({"model": "m", "prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids"),
    ({"model": "m", "prompt": "x", "echo": 1}, "echo"),
    ({"model": "m", "prompt": "x", "max_tokens": 0, "echo": False}, "max_tokens"),
    ({"model": "m", "prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"model": "m", "prompt": "x", "tools": [{"type": "function"}]}, "tools"),
    ({"model": "m", "prompt": "x", "response_format": {"type": "xml"}}, "response_format"),
    ({"model": "m", "prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"name": "a"}}},
     "response_format"),
    ({"model": "m", "prompt": "x", "structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"model": "m", "prompt": "x", "structured_outputs": {"choice": "b"}}, "structured_outputs.choice"),
    ({"model": "m", "prompt": "x", "presence_penalty": -3}, "presence_penalty"),
    ({"model": "m", "prompt": "x", "temperature": 3}, "temperature"),
    ({"model": "m", "prompt": "x", "temperature": "hot"}, "temperature"),
    ({"model": "m", "prompt": "x", "top_p": 1.5}, "top_p"),
    ({"model": "m", "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"model": "m", "prompt": "x", "max_tokens": True}, "max_tokens"),
    ({"model": "m", "prompt": "x", "logprobs": 21}, "logprobs"),
    ({"model": "m", "prompt": "x", "stop": [""]}, "stop"),
    ({"model": "m", "prompt": "x", "stream": "yes"}, "stream"),
    ({"model": "m", "prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"model": "m", "prompt": "x", "user": 5}, "user"),
])
def test_completion_refusals_name_the_parameter(body, param):
    """Unsupported or out-of-range values are a 400 whose param (and message prefix) is the parameter."""
    assert _param_of(body) == param


@pytest.mark.parametrize("body,param", [
    ({"model": "m", "messages": []}, "messages"),
    ({"model": "m", "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -1}, "max_completion_tokens"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "tool_choice": "auto"}, "tool_choice"),
])
def test_chat_refusals_name_the_parameter(body, param):
    """Chat-specific refusals name the parameter (with the message index where there is one)."""
    assert _param_of(body, chat=True) == param


def test_body_must_be_an_object():
    """A JSON array or string body is refused as a whole."""
    assert _param_of([1, 2]) == "body"  # type: ignore[arg-type]


def test_sampling_controls_parse_and_reach_the_generate_request():
    """n, penalties, logit_bias (string keys), min_tokens and stop_token_ids are parsed and carried into each
    choice's GenerateRequest; seeded choices get seed + index, ids request_id.index."""
    from gateway.openai_api.convert import choice_requests

    parsed = parse_request({"model": "m", "prompt": "x", "n": 3, "best_of": 3, "presence_penalty": 0.5,
                            "frequency_penalty": -0.25, "repetition_penalty": 1.2, "logit_bias": {"7": -100, "3": 2},
                            "min_tokens": 2, "stop_token_ids": [9], "seed": 5}, chat=False)
    assert parsed.n == 3 and parsed.logit_bias == ((3, 2.0), (7, -100.0)) and parsed.stop_token_ids == (9,)
    messages = choice_requests(parsed, "rid")
    assert [m.request_id for m in messages] == ["rid", "rid.1", "rid.2"]
    assert [m.sampling.seed for m in messages] == [5, 6, 7]
    first = messages[0]
    assert (first.sampling.presence_penalty, first.sampling.frequency_penalty, first.sampling.min_tokens) == (0.5, -0.25, 2)
    assert abs(first.sampling.repetition_penalty - 1.2) < 1e-6 and dict(first.sampling.logit_bias) == {3: 2.0, 7: -100.0}
    assert list(first.stop_token_ids) == [9]
    plain = choice_requests(parse_request({"model": "m", "prompt": "x"}, chat=False), "rid")[0]
    assert not plain.sampling.HasField("presence_penalty") and not plain.sampling.logit_bias


def test_echo_and_prompt_logprobs_reach_the_generate_request():
    """echo with logprobs N (and max_tokens 0) asks the prefill to score the prompt with N alternatives and
    generate one token (dropped by the answer); vLLM's prompt_logprobs asks the same; chat refuses echo."""
    from gateway.openai_api.convert import to_generate_request

    parsed = parse_request({"model": "m", "prompt": [3, 4, 5], "echo": True, "logprobs": 2, "max_tokens": 0}, chat=False)
    message = to_generate_request(parsed, "rid")
    assert parsed.max_tokens == 0 and message.max_tokens == 1 and message.prompt_logprobs == 2
    assert to_generate_request(parse_request({"model": "m", "prompt": "x", "echo": True}, chat=False), "r") \
        .HasField("prompt_logprobs") is False
    vllm = parse_request({"model": "m", "messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 0}, chat=True)
    assert to_generate_request(vllm, "r", [1, 2]).prompt_logprobs == 0
    assert _param_of({"model": "m", "messages": [{"role": "user", "content": "x"}], "echo": True}, chat=True) == "echo"


def test_structured_outputs_parse_to_one_grammar():
    """response_format json_object / json_schema and vLLM's structured_outputs (json, regex, choice, grammar) become
    one (kind, text) on the GenerateRequest; text means none."""
    from gateway.openai_api.convert import to_generate_request
    from rpc.convert import structured_from_proto

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    cases = [
        ({"response_format": {"type": "json_object"}}, ("json_object", "")),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema, "strict": True}}},
         ("json_schema", json.dumps(schema))),
        ({"structured_outputs": {"json": schema}}, ("json_schema", json.dumps(schema))),
        ({"structured_outputs": {"regex": "[0-9]+"}}, ("regex", "[0-9]+")),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, ("choice", '["yes", "no"]')),
        ({"structured_outputs": {"grammar": "start: \"a\""}}, ("grammar", 'start: "a"')),
        ({"response_format": {"type": "text"}}, None),
    ]
    for extra, expected in cases:
        parsed = parse_request({"model": "m", "prompt": "x", **extra}, chat=False)
        assert parsed.structured_output == expected
        message = to_generate_request(parsed, "r")
        assert (structured_from_proto(message.structured_output) if message.HasField("structured_output")
                else None) == expected
