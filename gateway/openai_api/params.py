"""OpenAI request bodies (JSON, already decoded) -> OpenAIRequest, a validated, typed request.

Pure functions: every rejection is an OpenAIError 400 whose `param` names the offending parameter.
Supported: model, prompt (completions: a string, token ids, or a one-element list of either) or messages
(chat), max_tokens / max_completion_tokens, temperature, top_p, top_k, min_p, stop, seed, logprobs /
top_logprobs, stream, stream_options.include_usage, user, n (best_of only equal to n), presence_penalty,
frequency_penalty, logit_bias, and the vLLM extensions ignore_eos, skip_special_tokens, repetition_penalty,
min_tokens and stop_token_ids; echo (completions; with max_tokens 0 for prompt scoring) and vLLM's
prompt_logprobs; response_format (json_object / json_schema) and vLLM's structured_outputs. Refused until
supported: suffix, tools / functions.
Other fields are ignored."""
from __future__ import annotations

import json
from dataclasses import dataclass

from gateway.openai_api.errors import bad_param
from gateway.openai_api.json_types import JsonObject, JsonValue

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions
MAX_TOP_LOGPROBS = 20
CHAT_ROLES = ("system", "developer", "user", "assistant")
# parameter -> the values that mean "not used"
_UNSUPPORTED = {
    "suffix": (None, ""), "tools": (None, []),
    "functions": (None, []), "tool_choice": (None, "none"), "function_call": (None, "none"),
}
MAX_CHOICES = 16  # n: choices per request, at most


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


@dataclass(frozen=True)
class OpenAIRequest:
    """One validated /v1/completions or /v1/chat/completions request. Exactly one of prompt_text,
    prompt_ids and messages is set. logprobs: alternatives per token in the answer (None: no logprobs)."""

    chat: bool
    model: str
    prompt_text: str | None = None
    prompt_ids: tuple[int, ...] | None = None
    messages: tuple[ChatMessage, ...] = ()
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    stop: tuple[str, ...] = ()
    seed: int | None = None
    logprobs: int | None = None
    stream: bool = False
    include_usage: bool = False
    user: str | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    n: int = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    echo: bool = False
    prompt_logprobs: int | None = None
    structured_output: tuple[str, str] | None = None  # (kind, text): engine.sampling_params.GRAMMAR_KINDS
    structured_param: str = "response_format"  # the parameter that asked for it (named by its errors)
    speculative: bool | None = None  # pdserve's extension: speculative decoding on / off for this request

    @property
    def scored_prompt(self) -> int | None:
        """Alternatives per prompt token the prefill must score (None: no prompt scoring): vLLM's prompt_logprobs,
        or, with echo and logprobs, the logprobs count."""
        counts = [c for c in (self.prompt_logprobs, self.logprobs if self.echo else None) if c is not None]
        return max(counts) if counts else None

    @property
    def prompt_param(self) -> str:
        return "messages" if self.chat else "prompt"

    @property
    def logprobs_param(self) -> str:
        return "top_logprobs" if self.chat else "logprobs"


def _number(body: JsonObject, name: str, low: float, high: float, integer: bool = False) -> int | float | None:
    value = body.get(name)
    if value is None:
        return None
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise bad_param(name, f"must be {'an integer' if integer else 'a number'}, got {value!r}")
    if not low <= value <= high:
        raise bad_param(name, f"must be in [{low:g}, {high:g}], got {value!r}")
    return value if integer else float(value)


def _flag(body: JsonObject, name: str, default: bool | None) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_param(name, f"must be true or false, got {value!r}")
    return value


def _refuse_unsupported(body: JsonObject) -> None:
    for name, unused in _UNSUPPORTED.items():
        value = body.get(name)
        if not any(value == allowed and isinstance(value, bool) == isinstance(allowed, bool) for allowed in unused):
            raise bad_param(name, f"is not supported by this server (got {value!r})")


def _stop(body: JsonObject) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(item, str) and item for item in items):
        raise bad_param("stop", "must be a non-empty string or a list of non-empty strings")
    return tuple(items)


def _token_ids(value: list[JsonValue]) -> tuple[int, ...] | None:
    if value and all(isinstance(item, int) and not isinstance(item, bool) for item in value):
        return tuple(value)
    return None


def _prompt(body: JsonObject) -> tuple[str | None, tuple[int, ...] | None]:
    value = body.get("prompt")
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]  # a batch of one prompt
    if isinstance(value, str):
        if not value:
            raise bad_param("prompt", "is empty")
        return value, None
    if isinstance(value, list):
        ids = _token_ids(value)
        if ids is not None:
            return None, ids
        if value and all(isinstance(item, (str, list)) for item in value):
            raise bad_param("prompt", f"holds {len(value)} prompts; this server takes one prompt per request")
    raise bad_param("prompt", "must be a non-empty string or a non-empty list of token ids")


def _content(index: int, message: JsonObject) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if content is None and message.get("role") == "assistant":
        return ""
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_param(f"messages[{index}].content", "only text parts ({\"type\": \"text\", \"text\": ...}) are supported")
            texts.append(part["text"])
        return "".join(texts)
    raise bad_param(f"messages[{index}].content", "must be a string or a list of text parts")


def _messages(body: JsonObject) -> tuple[ChatMessage, ...]:
    value = body.get("messages")
    if not isinstance(value, list) or not value:
        raise bad_param("messages", "must be a non-empty list of {role, content} objects")
    messages = []
    for index, message in enumerate(value):
        if not isinstance(message, dict):
            raise bad_param(f"messages[{index}]", "must be an object with role and content")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise bad_param(f"messages[{index}].role", f"must be one of {', '.join(CHAT_ROLES)}, got {role!r}")
        messages.append(ChatMessage(role, _content(index, message)))
    return tuple(messages)


def _logprobs(body: JsonObject, chat: bool) -> int | None:
    if not chat:  # completions: logprobs is the number of alternatives (0..20)
        return _number(body, "logprobs", 0, MAX_TOP_LOGPROBS, integer=True)
    wanted = _flag(body, "logprobs", False)
    top = _number(body, "top_logprobs", 0, MAX_TOP_LOGPROBS, integer=True)
    if top is not None and not wanted:
        raise bad_param("top_logprobs", "needs logprobs: true")
    return (top or 0) if wanted else None


def _max_tokens(body: JsonObject, chat: bool) -> int | None:
    """max_tokens 0 is allowed for prompt scoring only (completions with echo)."""
    name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    scoring = not chat and body.get("echo") is True
    value = _number(body, name, 0 if scoring else 1, 2**31 - 1, integer=True)
    if value is None and not chat:
        return COMPLETIONS_DEFAULT_MAX_TOKENS
    return value


def _choices(body: JsonObject) -> int:
    """n (1..MAX_CHOICES); best_of, when given, must equal n (the server returns every choice it makes)."""
    n = _number(body, "n", 1, MAX_CHOICES, integer=True) or 1
    best_of = _number(body, "best_of", 1, MAX_CHOICES, integer=True)
    if best_of is not None and best_of != n:
        raise bad_param("best_of", f"must equal n ({n}) on this server (it returns every choice it samples), got {best_of}")
    return n


def _logit_bias(body: JsonObject) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} (keys are strings of token ids), biases in [-100, 100]."""
    value = body.get("logit_bias")
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise bad_param("logit_bias", "must be an object mapping token ids to biases")
    pairs = []
    for key, bias in value.items():
        try:
            token = int(key)
        except ValueError:
            raise bad_param("logit_bias", f"keys must be token ids, got {key!r}") from None
        if token < 0:
            raise bad_param("logit_bias", f"keys must be token ids, got {key!r}")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise bad_param("logit_bias", f"biases must be numbers in [-100, 100], got {bias!r} for {key!r}")
        pairs.append((token, float(bias)))
    return tuple(sorted(pairs))


def _stop_token_ids(body: JsonObject) -> tuple[int, ...]:
    value = body.get("stop_token_ids")
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
        raise bad_param("stop_token_ids", "must be a list of token ids")
    return tuple(value)


def _stream_options(body: JsonObject, stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise bad_param("stream_options", "is only allowed with stream: true")
    if not isinstance(options, dict):
        raise bad_param("stream_options", "must be an object")
    value = options.get("include_usage", False)
    if not isinstance(value, bool):
        raise bad_param("stream_options.include_usage", f"must be true or false, got {value!r}")
    return value


def parse_request(body: JsonValue, chat: bool) -> OpenAIRequest:
    """Validates a /v1/chat/completions (chat) or /v1/completions body."""
    if not isinstance(body, dict):
        raise bad_param("body", "must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_param("model", "is required (a model name from GET /v1/models)")
    _refuse_unsupported(body)
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad_param("user", "must be a string")
    prompt_text, prompt_ids = (None, None) if chat else _prompt(body)
    stream = _flag(body, "stream", False)
    seed = _number(body, "seed", -(2**63), 2**64 - 1, integer=True)
    if seed is not None and seed < 0:
        seed &= 2**64 - 1  # OpenAI allows negative seeds; the engine takes an unsigned 64-bit one
    return OpenAIRequest(
        chat=chat, model=model, prompt_text=prompt_text, prompt_ids=prompt_ids,
        messages=_messages(body) if chat else (), max_tokens=_max_tokens(body, chat),
        temperature=_number(body, "temperature", 0.0, 2.0), top_p=_number(body, "top_p", 0.0, 1.0),
        top_k=_number(body, "top_k", -1, 2**31 - 1, integer=True), min_p=_number(body, "min_p", 0.0, 1.0),
        stop=_stop(body), seed=seed, logprobs=_logprobs(body, chat), stream=stream,
        include_usage=_stream_options(body, stream), user=user, ignore_eos=_flag(body, "ignore_eos", False),
        skip_special_tokens=_flag(body, "skip_special_tokens", True), n=_choices(body),
        presence_penalty=_number(body, "presence_penalty", -2.0, 2.0),
        frequency_penalty=_number(body, "frequency_penalty", -2.0, 2.0),
        repetition_penalty=_positive(body, "repetition_penalty"), logit_bias=_logit_bias(body),
        min_tokens=_number(body, "min_tokens", 0, 2**31 - 1, integer=True), stop_token_ids=_stop_token_ids(body),
        echo=_echo(body, chat), prompt_logprobs=_number(body, "prompt_logprobs", 0, MAX_TOP_LOGPROBS, integer=True),
        speculative=_flag(body, "speculative", None),  # type: ignore[arg-type]
        **_structured(body),
    )


def _structured(body: JsonObject) -> JsonObject:
    """OpenAI's response_format (text | json_object | json_schema) or vLLM's structured_outputs (exactly one of
    json, regex, choice, grammar, json_object) -> OpenAIRequest's structured_output fields. The grammar itself is
    compiled (and refused when it does not) by the gateway."""
    response_format, vllm = body.get("response_format"), body.get("structured_outputs")
    if response_format is not None and vllm is not None:
        raise bad_param("structured_outputs", "give response_format or structured_outputs, not both")
    if vllm is not None:
        return {"structured_output": _vllm_structured(vllm), "structured_param": "structured_outputs"}
    if response_format is None:
        return {}
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"structured_output": ("json_object", "")}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise bad_param("response_format", "json_schema needs {\"name\": ..., \"schema\": {...}}")
        return {"structured_output": ("json_schema", json.dumps(schema))}
    raise bad_param("response_format", f"type must be text, json_object or json_schema, got {kind!r}")


_VLLM_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar", "json_object": "json_object"}


def _vllm_structured(value: JsonValue) -> tuple[str, str]:
    given = {key: item for key, item in value.items() if item is not None and item is not False} \
        if isinstance(value, dict) else {}
    if len(given) != 1 or next(iter(given)) not in _VLLM_KINDS:
        raise bad_param("structured_outputs", f"must set exactly one of {', '.join(_VLLM_KINDS)}")
    key, item = next(iter(given.items()))
    if key == "json":
        if isinstance(item, str):
            return "json_schema", item
        if isinstance(item, dict):
            return "json_schema", json.dumps(item)
    elif key == "choice":
        if isinstance(item, list) and item and all(isinstance(option, str) for option in item):
            return "choice", json.dumps(item)
    elif key == "json_object":
        if item is True:
            return "json_object", ""
    elif isinstance(item, str) and item:
        return _VLLM_KINDS[key], item
    raise bad_param(f"structured_outputs.{key}", f"has the wrong type ({type(item).__name__})")


def _echo(body: JsonObject, chat: bool) -> bool:
    echo = _flag(body, "echo", False)
    if echo and chat:
        raise bad_param("echo", "is only supported on /v1/completions")
    return echo


def _positive(body: JsonObject, name: str) -> float | None:
    value = _number(body, name, 0.0, 100.0)
    if value is not None and value <= 0:
        raise bad_param(name, f"must be in (0, 100], got {value!r}")
    return value
