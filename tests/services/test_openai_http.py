"""The gateway's OpenAI-compatible HTTP API on the shared deployment, driven by the official `openai`
client: completions and chat, streaming and not, greedy text equal to the gRPC path's, usage, 400s naming
the parameter, a disconnecting client freeing its pages, /health, /v1/models and the request id in the
workers' log lines."""
from __future__ import annotations

import asyncio

import aiohttp
import grpc
import openai
import pytest

from gateway.client import build_request, generate
from gateway.tokenizer import TextTokenizer
from tests.services.conftest import worker_address
from tests.services.helpers import (at_rest, decode_load, gateway_stub, idle_free_pages, unspared_free_pages,
                                   wait_for_free_pages)

pytestmark = pytest.mark.slow
PROMPT = "def main(argv):\n    return"
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{cluster.http_address}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def grpc_text(address: str, prompt: str, max_tokens: int) -> str:
    async def run() -> str:
        async with gateway_stub(address) as stub:
            result = await generate(stub, build_request(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                                    timeout=120)
        return result.text

    return asyncio.run(run())


def test_completions_match_grpc_with_usage(cluster, client, model, service_model):
    """Greedy completions text (whole and streamed) equals the gRPC Generate text for the same prompt;
    usage counts the prompt's tokens and max_tokens generated tokens."""
    expected = grpc_text(cluster.gateway_address, PROMPT, 8)
    whole = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, **GREEDY)
    assert whole.choices[0].text == expected and whole.choices[0].finish_reason == "length"
    prompt_tokens = len(TextTokenizer.from_model_dir(service_model).encode(PROMPT))
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens, whole.usage.total_tokens) == \
        (prompt_tokens, 8, prompt_tokens + 8)
    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=8, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert chunks[-1].usage.completion_tokens == 8 and chunks[-2].choices[0].finish_reason == "length"


def test_chat_matches_grpc_on_the_templated_prompt(cluster, client, model):
    """Chat (no model template here: the default one) answers what gRPC answers for the templated text,
    streamed or not."""
    expected = grpc_text(cluster.gateway_address, "user: hello\nassistant:", 6)
    messages = [{"role": "user", "content": "hello"}]
    whole = client.chat.completions.create(model=model, messages=messages, max_completion_tokens=6, **GREEDY)
    assert whole.choices[0].message.content == expected and whole.usage.completion_tokens == 6
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=6, stream=True, **GREEDY)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) == expected


@pytest.mark.parametrize("kwargs,param", [({"temperature": 5.0}, "temperature"), ({"n": 17}, "n"),
                                          ({"logit_bias": {"999999": 1}}, "logit_bias"),
                                          ({"max_tokens": 100000}, "max_tokens")])
def test_bad_parameter_is_a_400_naming_it(client, model, kwargs, param):
    """Out-of-range, unsupported, or context-exceeding parameters: BadRequestError with param set."""
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=model, prompt=PROMPT, **kwargs)
    assert caught.value.status_code == 400 and caught.value.param == param


def test_unknown_model_is_a_404(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt=PROMPT)


async def test_disconnect_mid_stream_frees_pages(cluster):
    """A streaming HTTP client that closes its connection aborts the request: the decode worker's free
    pages return to the idle baseline and nothing is left running or leased."""
    decode = worker_address(cluster, "decode-0")
    baseline = await idle_free_pages(decode)
    url = f"http://{cluster.http_address}"
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{url}/v1/models") as response:
            model = (await response.json())["data"][0]["id"]
        body = {"model": model, "prompt": list(range(5, 300)), "max_tokens": 2000, "temperature": 0.0,
                "ignore_eos": True, "stream": True}
        response = await http.post(f"{url}/v1/completions", json=body)
        for _ in range(5):
            assert (await response.content.readuntil(b"\n\n")).startswith(b"data: ")
        during = unspared_free_pages(await decode_load(decode))
        response.close()  # drop the connection mid-stream
    assert during < baseline
    load = await wait_for_free_pages(decode, baseline, timeout=30)
    assert at_rest(load, baseline), load


async def test_health_and_models(cluster):
    """/health is 200 while every worker answers; /v1/models lists the served model."""
    async with aiohttp.ClientSession(f"http://{cluster.http_address}") as http:
        async with http.get("/health") as response:
            assert response.status == 200
        async with http.get("/v1/models") as response:
            cards = (await response.json())["data"]
    assert [card["object"] for card in cards] == ["model"] and cards[0]["max_model_len"] > 0


def test_request_id_reaches_every_service_log(cluster, client, model):
    """x-request-id from HTTP, and from gRPC metadata, names the request in the gateway's, the prefill
    worker's and the decode worker's log lines."""
    client.completions.create(model=model, prompt=PROMPT, max_tokens=3, extra_headers={"x-request-id": "http-trace-1"},
                              **GREEDY)

    async def over_grpc() -> str:
        async with grpc.aio.insecure_channel(cluster.gateway_address) as channel:
            from rpc.v1 import gateway_pb2_grpc

            stub = gateway_pb2_grpc.GatewayServiceStub(channel)
            call = stub.Generate(build_request([5, 6, 7], max_tokens=3, temperature=0.0, ignore_eos=True),
                                 metadata=(("x-request-id", "grpc-trace-2"),), timeout=120)
            return [response.request_id async for response in call][-1]

    assert asyncio.run(over_grpc()) == "grpc-trace-2"
    for name in ("gateway", "prefill-0", "decode-0"):  # each logs a line per request before it answers
        text = (cluster.log_dir / f"{name}.log").read_text()
        assert "request=http-trace-1" in text and "request=grpc-trace-2" in text, name


def test_bench_openai_backend(cluster, tmp_path):
    """`pdserve bench --backend openai` runs the random workload over HTTP: every request completes with
    exact token totals (from usage) and finite, ordered latencies."""
    import json
    import math

    from pdserve.cli import main

    out = tmp_path / "openai.jsonl"
    code = main(["bench", "--backend", "openai", "--base-url", f"http://{cluster.http_address}/v1", "--num-prompts", "6",
                 "--input-len", "24", "--output-len", "8", "--max-concurrency", "3", "--warmup-requests", "1",
                 "--no-progress", "--output-file", str(out), "--request-timeout", "300"])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["backend"] == "openai" and (result["completed"], result["failed"]) == (6, 0)
    assert (result["total_input_tokens"], result["total_output_tokens"]) == (6 * 24, 6 * 8)
    for name in ("ttft", "itl", "e2e_latency"):
        assert math.isfinite(result[f"median_{name}_ms"]) and result[f"median_{name}_ms"] > 0, name
    assert result["mean_e2e_latency_ms"] > result["mean_ttft_ms"]
