"""Chat messages -> prompt text, with the model's own chat template when it ships one.

The template comes from the model directory's chat_template.jinja, else tokenizer_config.json's
"chat_template" (a string, or a list of {name, template} of which "default" is used), rendered with jinja2
in a sandbox the way HF transformers does (variables: messages, add_generation_prompt, bos_token,
eos_token; raise_exception()). A model without one gets DEFAULT_CHAT_TEMPLATE:

    system: You are terse.
    user: Hello
    assistant:

Model templates usually write the special tokens (bos) themselves, so their text is tokenized without
adding special tokens; the default template's text is tokenized like a completions prompt."""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from gateway.openai_api.errors import OpenAIError, bad_param
from gateway.openai_api.json_types import JsonObject, JsonValue
from gateway.openai_api.params import ChatMessage

DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message.role }}: {{ message.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def _token_text(value: JsonValue) -> str:
    """tokenizer_config.json writes special tokens as a string or as {"content": str, ...}."""
    if isinstance(value, dict):
        value = value.get("content", "")
    return value if isinstance(value, str) else ""


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


@dataclass(frozen=True)
class ChatTemplate:
    """source: the jinja2 text; from_model: it came with the model (add_special_tokens False then)."""

    source: str = DEFAULT_CHAT_TEMPLATE
    from_model: bool = False
    bos_token: str = ""
    eos_token: str = ""

    def __post_init__(self) -> None:
        _ = self.template  # a template that does not compile fails at start-up, not per request

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ChatTemplate:
        path = Path(model_dir)
        config: JsonObject = {}
        if (path / "tokenizer_config.json").is_file():
            config = json.loads((path / "tokenizer_config.json").read_text())
        tokens = {"bos_token": _token_text(config.get("bos_token")), "eos_token": _token_text(config.get("eos_token"))}
        if (path / "chat_template.jinja").is_file():
            return cls((path / "chat_template.jinja").read_text(), True, **tokens)
        source = config.get("chat_template")
        if isinstance(source, list):
            named = {item.get("name"): item.get("template") for item in source if isinstance(item, dict)}
            source = named.get("default")
        if isinstance(source, str) and source.strip():
            return cls(source, True, **tokens)
        return cls(DEFAULT_CHAT_TEMPLATE, False, **tokens)

    @property
    def add_special_tokens(self) -> bool:
        return not self.from_model

    @cached_property
    def template(self) -> jinja2.Template:
        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        environment.globals["raise_exception"] = _raise_exception
        return environment.from_string(self.source)

    def render(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True) -> str:
        """The prompt text; a template error (e.g. raise_exception for a role order it refuses) is a 400
        naming messages."""
        try:
            text = self.template.render(messages=[{"role": m.role, "content": m.content} for m in messages],
                                   add_generation_prompt=add_generation_prompt, bos_token=self.bos_token,
                                   eos_token=self.eos_token)
        except jinja2.TemplateError as error:
            raise bad_param("messages", f"the model's chat template refused them: {error}") from error
        if not text:
            raise OpenAIError(400, "messages: the chat template produced an empty prompt", param="messages")
        return text
