"""Structured outputs on the shared deployment (1 prefill + 1 decode with the draft + gateway): the official openai
client's response_format json_schema (an object with required fields, enums and a nested array of objects), 20
requests sampled at temperature 1, with speculative decoding and without, and the same through the gRPC API:
every output json.loads and validates. A schema that does not compile is refused (400 / INVALID_ARGUMENT)
naming the problem, before any work."""
from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest

from gateway.client import build_request
from tests.services.helpers import gateway_stub
from tests.services.test_openai_http import client, model  # noqa: F401 - the shared openai client fixtures

pytestmark = pytest.mark.slow
PROMPT = "def main():\n    config = "
REQUESTS = 20
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "tags": {"type": "array", "maxItems": 3, "items": {
            "type": "object", "properties": {"id": {"type": "integer"}, "ok": {"type": "boolean"}},
            "required": ["id", "ok"], "additionalProperties": False}},
    },
    "required": ["name", "kind", "tags"],
    "additionalProperties": False,
}


def validate(text: str) -> None:
    """json.loads, then the schema's rules one by one (AssertionError naming what broke)."""
    value = json.loads(text)
    assert isinstance(value, dict) and set(value) == {"name", "kind", "tags"}, value
    assert isinstance(value["name"], str) and len(value["name"]) <= 12, value
    assert value["kind"] in ("cat", "dog", "bird"), value
    assert isinstance(value["tags"], list) and len(value["tags"]) <= 3, value
    for tag in value["tags"]:
        assert isinstance(tag, dict) and set(tag) == {"id", "ok"}, value
        assert isinstance(tag["id"], int) and not isinstance(tag["id"], bool) and isinstance(tag["ok"], bool), value


@pytest.mark.parametrize("speculative", [True, False])
def test_openai_json_schema_always_validates(client, model, speculative):  # noqa: F811
    """20 sampled completions (temperature 1, distinct seeds) with response_format json_schema: each text parses and
    validates and the finish_reason is stop (the grammar completed)."""
    response_format = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}}

    def one(seed: int):
        return client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "describe a pet as JSON"}], max_tokens=160,
            temperature=1.0, seed=seed, response_format=response_format, extra_body={"speculative": speculative})

    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(one, range(REQUESTS)))
    for response in responses:
        validate(response.choices[0].message.content)
        assert response.choices[0].finish_reason == "stop"
    assert len({r.choices[0].message.content for r in responses}) > 1


def test_first_token_is_masked(client, model):  # noqa: F811
    """The first token (sampled by the prefill worker) is masked too: unconstrained greedy output does not start with
    '{', constrained greedy output does and validates."""
    plain = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0)
    schema = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}}
    constrained = client.completions.create(model=model, prompt=PROMPT, max_tokens=160, temperature=0,
                                            extra_body={"response_format": schema})
    assert not plain.choices[0].text.startswith("{")
    validate(constrained.choices[0].text)


def test_invalid_schema_is_a_400_naming_the_problem(client, model):  # noqa: F811
    """An unknown JSON-schema type, and a regex that does not compile, are refused with 400 before any work."""
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object",
                                                                          "properties": {"a": {"type": "nonsense"}}}}}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], response_format=bad)
    assert caught.value.param == "response_format" and "nonsense" in str(caught.value)
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=model, prompt=PROMPT, extra_body={"structured_outputs": {"regex": "[a-"}})
    assert caught.value.param == "structured_outputs" and "regex" in str(caught.value)


def test_grpc_json_schema_always_validates(cluster):
    """The same 20 sampled requests through GatewayService.Generate with structured_output.json_schema (10 with
    speculation, 10 without): every output parses and validates; a bad schema is INVALID_ARGUMENT naming
    structured_output."""
    async def run() -> tuple[list[str], grpc.StatusCode, str]:
        async with gateway_stub(cluster.gateway_address) as stub:
            async def one(seed: int) -> str:
                request = build_request(PROMPT, max_tokens=160, temperature=1.0, seed=seed)
                request.structured_output.json_schema = json.dumps(SCHEMA)
                request.speculative = seed % 2 == 0
                return "".join([m.chunk.text async for m in stub.Generate(request, timeout=300)
                                if m.WhichOneof("kind") == "chunk"])

            texts = await asyncio.gather(*(one(seed) for seed in range(REQUESTS)))
            bad = build_request(PROMPT, max_tokens=4)
            bad.structured_output.regex = "(unclosed"
            try:
                await one_call(stub, bad)
            except grpc.aio.AioRpcError as error:
                return list(texts), error.code(), error.details()
            return list(texts), grpc.StatusCode.OK, ""

    texts, code, details = asyncio.run(run())
    for text in texts:
        validate(text)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("structured_output")


async def one_call(stub, request) -> None:
    async for _ in stub.Generate(request, timeout=60):
        pass
