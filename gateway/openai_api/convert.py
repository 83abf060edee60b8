"""OpenAIRequest -> the gateway's GenerateRequest (so both APIs share one validation and one request path),
and chat messages -> prompt token ids."""
from __future__ import annotations

from gateway.openai_api.chat_template import ChatTemplate
from gateway.openai_api.errors import bad_param
from gateway.openai_api.params import OpenAIRequest
from gateway.tokenizer import TextTokenizer
from rpc.convert import set_given, structured_to_proto
from rpc.v1 import gateway_pb2


def chat_prompt_ids(request: OpenAIRequest, template: ChatTemplate, tokenizer: TextTokenizer | None) -> list[int]:
    """The chat template's text, tokenized (without added special tokens when the template is the model's)."""
    if tokenizer is None:
        raise bad_param("messages", "this model has no tokenizer.json; use /v1/completions with token ids")
    ids = tokenizer.encode(template.render(request.messages), add_special_tokens=template.add_special_tokens)
    if not ids:
        raise bad_param("messages", "tokenize to no tokens")
    return ids


def to_generate_request(request: OpenAIRequest, request_id: str,
                        prompt_ids: list[int] | None = None) -> gateway_pb2.GenerateRequest:
    """prompt_ids: the chat prompt (chat_prompt_ids); completions use the request's own prompt.
    Logprobs: the engine is asked for at least one alternative (0 would mean none at all) and the
    answer keeps the requested number."""
    message = gateway_pb2.GenerateRequest(request_id=request_id, stop=list(request.stop),
                                          ignore_eos=request.ignore_eos,
                                          skip_special_tokens=request.skip_special_tokens)
    ids = prompt_ids if prompt_ids is not None else request.prompt_ids
    if ids is not None:
        message.token_ids.ids.extend(ids)
    else:
        assert request.prompt_text is not None
        message.text = request.prompt_text
    if request.max_tokens is not None:
        message.max_tokens = max(1, request.max_tokens)  # 0 (prompt scoring): one token, dropped by the answer
    if request.logprobs is not None:
        message.top_logprobs = max(1, request.logprobs)
    if request.scored_prompt is not None:
        message.prompt_logprobs = request.scored_prompt
    set_given(message.sampling, request, ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
                                          "frequency_penalty", "repetition_penalty", "min_tokens"))
    message.sampling.logit_bias.update(dict(request.logit_bias))
    message.stop_token_ids.extend(request.stop_token_ids)
    if request.speculative is not None:
        message.speculative = request.speculative
    if request.structured_output is not None:
        message.structured_output.CopyFrom(structured_to_proto(*request.structured_output))
    return message


def choice_requests(request: OpenAIRequest, request_id: str,
                    prompt_ids: list[int] | None = None) -> list[gateway_pb2.GenerateRequest]:
    """The n GenerateRequests behind one request with n choices: choice i runs as request_id (i = 0) or
    request_id.i, with seed + i when a seed is given (so seeded choices differ but stay reproducible)."""
    messages = []
    for index in range(request.n):
        message = to_generate_request(request, request_id if index == 0 else f"{request_id}.{index}", prompt_ids)
        if index and request.seed is not None:
            message.sampling.seed = (request.seed + index) % 2**64
        messages.append(message)
    return messages
