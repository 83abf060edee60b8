"""GenerateRequest (protobuf) -> GenerateJob (domain): validation, defaults and tokenization.

Every rejection is an InvalidArgument whose message starts with the offending field's name."""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from engine.sampling_params import SamplingParams
from gateway.model_info import ModelFacts
from gateway.structured import check_structured_output
from gateway.tokenizer import TextTokenizer
from rpc.convert import MAX_STREAM_INTERVAL, present_fields
from rpc.status import InvalidArgument
from rpc.v1 import gateway_pb2

MAX_REQUEST_ID_LENGTH = 256
# SamplingParams' field names (they start its ValueError messages) -> the request field to name.
_FIELD_NAMES = {
    "max_new_tokens": "max_tokens", "temperature": "sampling.temperature", "top_k": "sampling.top_k",
    "top_p": "sampling.top_p", "min_p": "sampling.min_p", "seed": "sampling.seed",
    "logprobs": "top_logprobs", "block_size": "block_size", "presence_penalty": "sampling.presence_penalty",
    "frequency_penalty": "sampling.frequency_penalty", "repetition_penalty": "sampling.repetition_penalty",
    "logit_bias": "sampling.logit_bias", "min_tokens": "sampling.min_tokens", "prompt_logprobs": "prompt_logprobs",
}
_ADJUSTMENTS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens")  # SamplingParams' own


@dataclass(frozen=True)
class GenerateJob:
    """One validated request: what the orchestrator runs."""

    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams  # max_new_tokens resolved; eos handling by the engine
    stop: tuple[str, ...] = ()
    skip_special_tokens: bool = True
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    stream_interval: int = 1  # tokens per decode message (1: every step's tokens at once)

    def ends_on(self, token_id: int) -> bool:
        """Whether generating this token finishes the request (eos unless ignored, or a stop token)."""
        if token_id in self.params.stop_token_ids:
            return True
        return not self.params.ignore_eos and token_id in self.eos_token_ids


def check_input(request: gateway_pb2.GenerateRequest, facts: ModelFacts, tokenizer: TextTokenizer | None,
                both_inputs: bool = False, max_text_bytes: int | None = None) -> str | list[int]:
    """The cheap checks that come before tokenising: request id, the input oneof, token ids (in the
    vocabulary), the text's size. Returns the text to tokenise, or the prompt's token ids (checked)."""
    if len(request.request_id) > MAX_REQUEST_ID_LENGTH:
        raise InvalidArgument("request_id", f"longer than {MAX_REQUEST_ID_LENGTH} characters")
    if both_inputs:
        raise InvalidArgument("input", "set exactly one of text and token_ids, not both")
    which = request.WhichOneof("input")
    if which is None:
        raise InvalidArgument("input", "set one of text and token_ids")
    if which == "token_ids":
        return _token_ids(request, facts)
    if not request.text:
        raise InvalidArgument("input.text", "is empty")
    if tokenizer is None:
        raise InvalidArgument("input.text", "this model has no tokenizer.json; send token_ids")
    if max_text_bytes is not None and len(request.text) > max_text_bytes // 4:  # 4 bytes per character at most
        size = len(request.text.encode("utf-8"))
        if size > max_text_bytes:
            raise InvalidArgument("input.text", f"{size} bytes exceeds the gateway's limit of {max_text_bytes}")
    return request.text


def _token_ids(request: gateway_pb2.GenerateRequest, facts: ModelFacts) -> list[int]:
    ids = list(request.token_ids.ids)
    if not ids:
        raise InvalidArgument("input.token_ids", "is empty")
    for index, token in enumerate(ids):
        if not 0 <= token < facts.vocab_size:
            raise InvalidArgument(f"input.token_ids[{index}]", f"{token} is outside the vocabulary [0, {facts.vocab_size})")
    return ids


def _prompt_ids(request: gateway_pb2.GenerateRequest, facts: ModelFacts, tokenizer: TextTokenizer | None,
                both_inputs: bool, prompt_ids: list[int] | None) -> list[int]:
    if prompt_ids is None:
        checked = check_input(request, facts, tokenizer, both_inputs)
        if not isinstance(checked, str):
            return checked
        assert tokenizer is not None
        prompt_ids = tokenizer.encode(checked)
    if not prompt_ids:  # (token ids are never empty here: check_input refused them)
        raise InvalidArgument("input.text", "tokenizes to no tokens")
    return prompt_ids


def _max_tokens(request: gateway_pb2.GenerateRequest, facts: ModelFacts, prompt_len: int, default_max: int) -> int:
    room = facts.max_context - prompt_len
    if room <= 0:
        raise InvalidArgument("input", f"prompt of {prompt_len} tokens leaves no room in the model context of {facts.max_context}")
    if request.HasField("max_tokens"):
        if request.max_tokens <= 0:
            raise InvalidArgument("max_tokens", f"must be positive, got {request.max_tokens}")
        if request.max_tokens > room:
            raise InvalidArgument("max_tokens", f"prompt ({prompt_len}) + max_tokens ({request.max_tokens}) exceeds the model context of {facts.max_context}")
        return request.max_tokens
    return max(1, min(facts.defaults.max_new_tokens or default_max, room))


def _sampling_params(request: gateway_pb2.GenerateRequest, facts: ModelFacts, max_tokens: int,
                     tokenizer: TextTokenizer | None = None) -> SamplingParams:
    sampling, defaults = request.sampling, facts.defaults
    values: dict[str, object] = {"max_new_tokens": max_tokens, "ignore_eos": request.ignore_eos}
    for name in ("temperature", "top_k", "top_p", "min_p"):
        if sampling.HasField(name):
            value = getattr(sampling, name)
            values[name] = value
        elif getattr(defaults, name) is not None:
            values[name] = getattr(defaults, name)
    if sampling.HasField("seed"):
        values["seed"] = int(sampling.seed)
    values.update(present_fields(sampling, _ADJUSTMENTS))
    for token in sampling.logit_bias:
        if not 0 <= token < facts.vocab_size:
            raise InvalidArgument("sampling.logit_bias", f"token id {token} is outside the vocabulary [0, {facts.vocab_size})")
    values["logit_bias"] = dict(sampling.logit_bias)
    for index, token in enumerate(request.stop_token_ids):
        if not 0 <= token < facts.vocab_size:
            raise InvalidArgument(f"stop_token_ids[{index}]", f"{token} is outside the vocabulary [0, {facts.vocab_size})")
    values["stop_token_ids"] = tuple(request.stop_token_ids)
    if request.HasField("top_logprobs"):
        values["logprobs"] = request.top_logprobs
    values.update(present_fields(request, ("speculative", "block_size", "prompt_logprobs")))
    values["structured_output"] = check_structured_output(request, facts, tokenizer)
    try:
        return SamplingParams(**values)
    except ValueError as error:
        name = str(error).split(" ", 1)[0]
        raise InvalidArgument(_FIELD_NAMES.get(name, "sampling"), str(error)) from error


def parse_generate_request(request: gateway_pb2.GenerateRequest, facts: ModelFacts, tokenizer: TextTokenizer | None,
                           default_max_tokens: int, both_inputs: bool = False,
                           prompt_ids: list[int] | None = None) -> GenerateJob:
    """Validates and converts; both_inputs: the wire message set text AND token_ids (protobuf keeps
    only the last member of a oneof, so the caller detects this on the raw bytes). prompt_ids: the
    caller ran check_input on this request and passes its token ids, or its text as the caller tokenised
    it (off the event loop); None: checked and tokenised here."""
    request_id = request.request_id or uuid.uuid4().hex
    prompt = _prompt_ids(request, facts, tokenizer, both_inputs, prompt_ids)
    max_tokens = _max_tokens(request, facts, len(prompt), default_max_tokens)
    params = _sampling_params(request, facts, max_tokens, tokenizer)
    for index, stop in enumerate(request.stop):
        if not stop:
            raise InvalidArgument(f"stop[{index}]", "is empty")
    if request.stop and tokenizer is None:
        raise InvalidArgument("stop", "stop strings need a tokenizer; this model has none")
    skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
    return GenerateJob(request_id=request_id, prompt_ids=tuple(prompt), params=params, stop=tuple(request.stop),
                       skip_special_tokens=skip, eos_token_ids=facts.eos_token_ids,
                       stream_interval=_stream_interval(request))


def _stream_interval(request: gateway_pb2.GenerateRequest) -> int:
    if not request.HasField("stream_interval"):
        return 1
    if not 1 <= request.stream_interval <= MAX_STREAM_INTERVAL:
        raise InvalidArgument("stream_interval", f"must be in 1..{MAX_STREAM_INTERVAL}, got {request.stream_interval}")
    return request.stream_interval
