"""The HTTP front in process over a scripted GatewayService: OpenAI bodies and SSE framing, errors with
their HTTP statuses, x-request-id, /health, /v1/models, /metrics counting, and a client that disconnects
mid-stream cancelling its run."""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.http_server import HttpFront, start_http
from gateway.metrics import GatewayMetrics
from gateway.model_info import ModelFacts
from gateway.openai_api.chat_template import ChatTemplate
from gateway.orchestrator import ErrorEvent, FinishEvent, TokensEvent
from rpc.status import ResourceExhausted, Unavailable, status_of


@dataclass
class FakeRun:
    events: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)
    cancelled: bool = False
    decoding: asyncio.Event = field(default_factory=asyncio.Event)

    def cancel(self) -> None:
        self.cancelled = True


class FakeTokenizer:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % 50 + 4 for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(f"<{i}>" for i in ids)


class FakeService:
    def __init__(self) -> None:
        self.facts = ModelFacts("tiny", 320, 4096, (1,))
        self.tokenizer = FakeTokenizer()
        self.metrics = GatewayMetrics()
        self.submitted: list[Any] = []
        self.gates: list[asyncio.Event | None] = []  # the `after` each submit got (n > 1: choice 0's decoding)
        self.runs: list[FakeRun | Exception] = []

    async def submit(self, message: Any, both_inputs: bool, arrival: float, deadline: float | None,
                     after: asyncio.Event | None = None) -> FakeRun:
        self.submitted.append(message)
        self.gates.append(after)
        run = self.runs.pop(0)
        if isinstance(run, Exception):
            raise run
        return run


def scripted(*events: Any) -> FakeRun:
    run = FakeRun()
    for event in events:
        run.events.put_nowait(event)
    return run


FINISH = FinishEvent("length", prompt_tokens=3, completion_tokens=2, ttft_ms=1.0, decode_steps=1, decode_tokens=1)


@pytest.fixture
async def front() -> AsyncIterator[tuple[FakeService, str, dict[str, bool]]]:
    service, health = FakeService(), {"ok": True}
    runner, address = await start_http(HttpFront(service, ChatTemplate(), lambda: health["ok"]), "127.0.0.1:0")  # type: ignore[arg-type]
    yield service, f"http://{address}", health
    await runner.cleanup()


async def test_completion_body_usage_and_request_id(front):
    """Non-streaming completion: the texts joined, finish_reason, usage; x-request-id kept end to end."""
    service, url, _ = front
    service.runs.append(scripted(TokensEvent([5], "he"), TokensEvent([6], "llo"), FINISH))
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": [7, 8, 9], "max_tokens": 2},
                                headers={"x-request-id": "abc"}) as response:
            body = await response.json()
            assert response.status == 200 and response.headers["x-request-id"] == "abc"
    assert body["id"] == "cmpl-abc" and body["choices"][0]["text"] == "hello"
    assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["total_tokens"] == 5
    assert service.submitted[0].request_id == "abc" and list(service.submitted[0].token_ids.ids) == [7, 8, 9]
    assert service.submitted[0].max_tokens == 2


async def test_chat_stream_framing(front):
    """Chat SSE: role chunk, content chunks, finish chunk, usage chunk (include_usage), then [DONE]."""
    service, url, _ = front
    service.runs.append(scripted(TokensEvent([5], "hi"), FINISH))
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{url}/v1/chat/completions", json={
                "model": "tiny", "messages": [{"role": "user", "content": "x"}], "stream": True,
                "stream_options": {"include_usage": True}}) as response:
            assert response.headers["Content-Type"].startswith("text/event-stream")
            raw = (await response.read()).decode()
    events = [line[6:] for line in raw.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == "hi"
    assert chunks[-2]["choices"][0]["finish_reason"] == "length" and chunks[-1]["usage"]["completion_tokens"] == 2
    assert list(service.submitted[0].token_ids.ids) == FakeTokenizer().encode("user: x\nassistant:")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("run,status", [
    (lambda: ResourceExhausted("no decode worker has room"), 429),
    (lambda: Unavailable("no reachable decode worker"), 503),
    (lambda: scripted(ErrorEvent(status_of(Unavailable("decode worker gone")))), 503),
])
async def test_errors_have_their_http_status(front, run, status, stream):
    """Admission timeout -> 429, no worker -> 503, raised at submission or as the run's first event,
    streaming or not: a plain OpenAI error body with that status."""
    service, url, _ = front
    service.runs.append(run())
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "x", "stream": stream}) as response:
            body = await response.json()
    assert response.status == status and set(body["error"]) == {"message", "type", "param", "code"}


async def test_bad_parameter_and_unknown_model(front):
    """A bad parameter is a 400 naming it; an unknown model a 404; neither reaches the service."""
    service, url, _ = front
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "x", "n": 17}) as response:
            assert response.status == 400 and (await response.json())["error"]["param"] == "n"
        async with session.post(f"{url}/v1/completions", json={"model": "other", "prompt": "x"}) as response:
            assert response.status == 404 and (await response.json())["error"]["code"] == "model_not_found"
        async with session.post(f"{url}/v1/completions", data=b"{not json") as response:
            assert response.status == 400
    assert service.submitted == []


async def test_disconnect_mid_stream_cancels_the_run(front):
    """A streaming client that goes away cancels its run (which aborts it on the workers)."""
    service, url, _ = front
    run = scripted(TokensEvent([5], "a"))
    service.runs.append(run)
    async with aiohttp.ClientSession() as session:
        response = await session.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "x", "stream": True})
        assert (await response.content.readuntil(b"\n\n")).startswith(b"data: ")
        response.close()  # drop the connection while the run waits for more tokens
    deadline = time.monotonic() + 60
    while not run.cancelled:
        assert time.monotonic() < deadline, "the run was not cancelled after the client disconnected"
        await asyncio.sleep(0.01)


async def test_health_models_and_metrics(front):
    """/health follows the workers; /v1/models lists the model; /metrics counts requests by status and code."""
    service, url, health = front
    service.runs.extend([scripted(FINISH), ResourceExhausted("full")])
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{url}/health") as response:
            assert response.status == 200
        health["ok"] = False
        async with session.get(f"{url}/health") as response:
            assert response.status == 503
        async with session.get(f"{url}/v1/models") as response:
            assert [card["id"] for card in (await response.json())["data"]] == ["tiny"]
        for _ in range(2):
            async with session.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "x"}) as response:
                await response.read()
        async with session.get(f"{url}/metrics") as response:
            text = await response.text()
    samples = {(s.name, s.labels.get("status"), s.labels.get("code")): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    assert samples[("pdserve_requests_total", "length", "200")] == 1
    assert samples[("pdserve_requests_total", "error", "429")] == 1


async def test_long_bodies_are_accepted_up_to_the_grpc_limit(front):
    """A 2 MiB prompt (over aiohttp's default 1 MiB) reaches the service; an oversized body is a 413."""
    service, url, _ = front
    service.runs.append(scripted(FINISH))
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "x" * 2**21}) as response:
            assert response.status == 200
        async with session.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "x" * 2**27}) as response:
            assert response.status == 413 and (await response.json())["error"]["param"] == "body"
    assert len(service.submitted[0].text) == 2**21


async def test_n_choices_stream_and_collect(front):
    """n=2: two runs behind one response; the whole body has choices 0 and 1 and usage over both; the stream
    carries each choice's text under its index, a finish chunk per choice, then one usage chunk."""
    service, url, _ = front
    for _ in range(2):
        service.runs.append(scripted(TokensEvent([5], "a"), FINISH))
    service.runs.append(scripted(TokensEvent([5], "a"), TokensEvent([6], "b"), FINISH))
    service.runs.append(scripted(TokensEvent([7], "c"), FINISH))
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "x", "n": 2}) as response:
            body = await response.json()
        async with session.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "x", "n": 2, "stream": True,
                                                               "stream_options": {"include_usage": True}}) as response:
            events = [json.loads(line[6:]) for line in (await response.text()).split("\n\n")
                      if line.startswith("data: {")]
    assert [c["index"] for c in body["choices"]] == [0, 1] and [c["text"] for c in body["choices"]] == ["a", "a"]
    assert body["usage"]["completion_tokens"] == 4
    texts: dict[int, str] = {0: "", 1: ""}
    finished = []
    for event in events[:-1]:
        (choice,) = event["choices"]
        texts[choice["index"]] += choice["text"]
        if choice["finish_reason"]:
            finished.append(choice["index"])
    assert texts == {0: "ab", 1: "c"} and sorted(finished) == [0, 1]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 4
    assert [m.request_id for m in service.submitted][1::2] == [m.request_id + ".1" for m in service.submitted][::2]
    # choice 1 is gated on choice 0's first token (the prompt is computed once); choice 0 starts at once
    assert service.gates[0] is None and service.gates[1] is not None
