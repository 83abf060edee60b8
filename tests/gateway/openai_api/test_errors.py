"""gRPC statuses of the gateway -> OpenAI errors: the right HTTP status, and INVALID_ARGUMENT naming the
OpenAI parameter behind the gateway's field."""
from __future__ import annotations

import grpc
import pytest

from gateway.openai_api.errors import OpenAIError, from_status


@pytest.mark.parametrize("code,status", [
    (grpc.StatusCode.INVALID_ARGUMENT, 400), (grpc.StatusCode.NOT_FOUND, 404),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, 429), (grpc.StatusCode.UNAVAILABLE, 503),
    (grpc.StatusCode.DEADLINE_EXCEEDED, 504), (grpc.StatusCode.INTERNAL, 500),
])
def test_http_status_for_grpc_status(code, status):
    """Each gRPC status the gateway raises has one HTTP status."""
    assert from_status(code, "x").status == status


@pytest.mark.parametrize("message,prompt_param,logprobs_param,param", [
    ("max_tokens: prompt (5) + max_tokens (9) exceeds the model context of 8", "prompt", "logprobs", "max_tokens"),
    ("input.token_ids[3]: 999 is outside the vocabulary", "prompt", "logprobs", "prompt"),
    ("input.text: tokenizes to no tokens", "messages", "top_logprobs", "messages"),
    ("sampling.top_k: must be >= -1", "prompt", "logprobs", "top_k"),
    ("top_logprobs: at most 20", "messages", "top_logprobs", "top_logprobs"),
    ("top_logprobs: at most 20", "prompt", "logprobs", "logprobs"),
])
def test_invalid_argument_names_the_openai_parameter(message, prompt_param, logprobs_param, param):
    """The gateway's field name becomes the OpenAI parameter, in param and at the start of the message."""
    error = from_status(grpc.StatusCode.INVALID_ARGUMENT, message, prompt_param, logprobs_param)
    assert error.param == param and error.message.startswith(f"{param}: ")


def test_error_body_shape():
    """The body is OpenAI's {"error": {message, type, param, code}}."""
    body = OpenAIError(429, "full", error_type="rate_limit_error", code="resource_exhausted").body()
    assert body == {"error": {"message": "full", "type": "rate_limit_error", "param": None, "code": "resource_exhausted"}}
