"""OpenAIRequest -> the gateway's GenerateRequest (so both APIs share one validation and one request path),
and chat messages -> prompt token ids."""
from __future__ import annotations

from gateway.openai_api.chat_template import ChatTemplate
from gateway.openai_api.errors import bad_param
from gateway.openai_api.params import OpenAIRequest
from gateway.tokenizer import TextTokenizer
from rpc.convert import set_given
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
        message.max_tokens = request.max_tokens
    if request.logprobs is not None:
        message.top_logprobs = max(1, request.logprobs)
    set_given(message.sampling, request, ("temperature", "top_p", "top_k", "min_p", "seed"))
    return message
