"""OpenAI-style errors: the exception the HTTP layer raises, its JSON body, and the one mapping from a
gRPC status (what GatewayService raises) to an HTTP status and an OpenAI error type.

Body: {"error": {"message": str, "type": str, "param": str | None, "code": str | None}}."""
from __future__ import annotations


import grpc

from gateway.openai_api.json_types import JsonObject

# gRPC status -> (HTTP status, OpenAI error type)
_HTTP_FOR_GRPC: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "conflict_error"),
    grpc.StatusCode.ABORTED: (409, "conflict_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
    grpc.StatusCode.UNIMPLEMENTED: (501, "not_implemented_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
}
# Gateway field names (InvalidArgument.field prefixes) -> the OpenAI parameter to name.
_PARAM_FOR_FIELD = {
    "sampling.temperature": "temperature", "sampling.top_p": "top_p", "sampling.top_k": "top_k",
    "sampling.min_p": "min_p", "sampling.seed": "seed", "sampling": "temperature", "stop_token_ids": "stop_token_ids",
    "sampling.presence_penalty": "presence_penalty", "sampling.frequency_penalty": "frequency_penalty",
    "sampling.repetition_penalty": "repetition_penalty", "sampling.logit_bias": "logit_bias",
    "sampling.min_tokens": "min_tokens",
}


class OpenAIError(Exception):
    """A request the HTTP API answers with `status` and an OpenAI error body."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 error_type: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.error_type = error_type
        self.code = code

    def body(self) -> JsonObject:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}


def bad_param(param: str, reason: str) -> OpenAIError:
    """400 naming the parameter; the message starts with its name (as the gRPC API's do)."""
    return OpenAIError(400, f"{param}: {reason}", param=param)


def openai_param(field: str, prompt_param: str, logprobs_param: str, structured_param: str = "response_format") -> str:
    """The OpenAI parameter behind a gateway field name (input.* is the prompt or the messages)."""
    base = field.split("[", 1)[0]
    if base.startswith("input"):
        return prompt_param
    if base == "top_logprobs":
        return logprobs_param
    if base == "structured_output":
        return structured_param
    return _PARAM_FOR_FIELD.get(base, base)


def from_status(code: grpc.StatusCode, message: str, prompt_param: str = "prompt",
                logprobs_param: str = "logprobs", structured_param: str = "response_format") -> OpenAIError:
    """The OpenAIError for a gRPC status raised by the gateway; INVALID_ARGUMENT names the parameter
    (gateway messages start with `field: `)."""
    status, error_type = _HTTP_FOR_GRPC.get(code, (500, "internal_error"))
    param = None
    if code == grpc.StatusCode.INVALID_ARGUMENT and ": " in message:
        field, reason = message.split(": ", 1)
        if " " not in field:
            param = openai_param(field, prompt_param, logprobs_param, structured_param)
            message = f"{param}: {reason}"
    return OpenAIError(status, message, param=param, error_type=error_type, code=code.name.lower())
