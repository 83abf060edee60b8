"""Chat prompts: the model's template from tokenizer_config.json (or chat_template.jinja) when present,
else the documented default; template errors are a 400 naming messages."""
from __future__ import annotations

import json

import jinja2
import pytest

from gateway.openai_api.chat_template import DEFAULT_CHAT_TEMPLATE, ChatTemplate
from gateway.openai_api.errors import OpenAIError
from gateway.openai_api.params import ChatMessage

MESSAGES = (ChatMessage("system", "Be terse."), ChatMessage("user", "Hi"))


def test_default_template_when_the_model_has_none(tmp_path):
    """No chat_template: role-prefixed lines and an assistant prompt; special tokens added at tokenization."""
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    template = ChatTemplate.from_model_dir(tmp_path)
    assert template.source == DEFAULT_CHAT_TEMPLATE and template.add_special_tokens
    assert template.render(MESSAGES) == "system: Be terse.\nuser: Hi\nassistant:"


def test_model_template_from_tokenizer_config(tmp_path):
    """tokenizer_config.json's chat_template is rendered with bos_token (a dict form too) and
    add_generation_prompt; its text is tokenized without adding special tokens."""
    source = ("{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
              "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": {"content": "<s>"}, "chat_template": source}))
    template = ChatTemplate.from_model_dir(tmp_path)
    assert template.from_model and not template.add_special_tokens
    assert template.render(MESSAGES) == "<s><|system|>Be terse.<|user|>Hi<|assistant|>"


def test_named_template_list_and_jinja_file(tmp_path):
    """A list of named templates uses "default"; chat_template.jinja wins over tokenizer_config.json."""
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ messages|length }}"}]}))
    assert ChatTemplate.from_model_dir(tmp_path).render(MESSAGES) == "D2"
    (tmp_path / "chat_template.jinja").write_text("J")
    assert ChatTemplate.from_model_dir(tmp_path).render(MESSAGES) == "J"


def test_raise_exception_is_a_400_naming_messages():
    """A template that refuses the messages (raise_exception) gives OpenAIError 400, param messages."""
    template = ChatTemplate("{% if messages[0].role != 'user' %}{{ raise_exception('user first') }}{% endif %}x", True)
    with pytest.raises(OpenAIError) as caught:
        template.render(MESSAGES)
    assert caught.value.status == 400 and caught.value.param == "messages" and "user first" in caught.value.message


def test_broken_template_fails_at_construction():
    """A template that does not compile is refused when loaded, not on the first request."""
    with pytest.raises(jinja2.TemplateSyntaxError):
        ChatTemplate("{% for %}", True)
