"""The OpenAI-compatible HTTP endpoint as the benchmark sees it (`pdserve bench --backend openai`): the
same workloads as the gRPC client, sent as streaming /v1/completions requests, each -> RequestRecord.

Token counts: OpenAI chunks do not say how many tokens they carry, so each request's completion tokens
(from stream_options.include_usage) are spread evenly over its text-carrying chunks for the ITL figures;
TTFT, end-to-end latency and throughput do not depend on that. Acceptance is not reported over HTTP."""
from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp

from bench.client import GatewayUnreachable, ModelSummary
from bench.config import SamplingOptions
from bench.record import RequestRecord
from bench.workload import BenchRequest


def completion_body(model: str, request: BenchRequest, options: SamplingOptions) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "prompt": list(request.token_ids) if request.token_ids else request.text,
                            "max_tokens": request.output_len, "ignore_eos": request.ignore_eos, "stream": True,
                            "stream_options": {"include_usage": True}}
    for name in ("temperature", "top_p", "top_k"):
        value = getattr(options, name)
        if value is not None:
            body[name] = value
    return body


def even_counts(total: int, chunks: int) -> list[int]:
    """total tokens spread over chunks as evenly as integers allow (earlier chunks get the remainder)."""
    if chunks <= 0:
        return []
    base, extra = divmod(total, chunks)
    return [base + (1 if index < extra else 0) for index in range(chunks)]


class OpenAIClient:
    """One shared aiohttp session to base_url (e.g. http://127.0.0.1:8000/v1); `send` never raises for
    HTTP failures (they become record.error)."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, options: SamplingOptions = SamplingOptions()) -> None:
        self._session = session
        self._base = base_url.rstrip("/")
        self.options = options
        self.model = ""

    async def model_info(self, address: str, timeout_s: float) -> ModelSummary:
        try:
            async with self._session.get(f"{self._base}/models", timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
                response.raise_for_status()
                card = (await response.json())["data"][0]
        except (aiohttp.ClientError, asyncio.TimeoutError, KeyError, IndexError) as error:
            raise GatewayUnreachable(f"no OpenAI API answered at {address} within {timeout_s:g} s: {error!r}") from None
        self.model = card["id"]
        return ModelSummary(card["id"], int(card.get("vocab_size", 0)), int(card.get("max_model_len", 0)),
                            frozenset(card.get("eos_token_ids", ())))

    async def send(self, request: BenchRequest) -> RequestRecord:
        record = RequestRecord.of(request)
        chunk_times: list[float] = []
        start = time.perf_counter()
        timeout = aiohttp.ClientTimeout(total=self.options.timeout_s)
        try:
            async with self._session.post(f"{self._base}/completions", json=completion_body(self.model, request, self.options),
                                          timeout=timeout) as response:
                if response.status != 200:
                    record.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                    return record
                async for line in response.content:
                    if not line.startswith(b"data: "):
                        continue
                    now = time.perf_counter() - start
                    if line.startswith(b"data: [DONE]"):
                        record.e2e_s = now
                        break
                    self._read_event(json.loads(line[6:]), record, chunk_times, now)
        except (aiohttp.ClientError, asyncio.TimeoutError) as error:
            record.error = record.error or f"{type(error).__name__}: {error}"
        counts = even_counts(record.output_tokens, len(chunk_times))
        record.ttft_s = chunk_times[0] if chunk_times else 0.0
        record.end_stream(chunk_times, counts, "a finish_reason")
        return record

    @staticmethod
    def _read_event(event: dict[str, Any], record: RequestRecord, chunk_times: list[float], now: float) -> None:
        if "error" in event:
            record.error = f"{event['error'].get('type')}: {event['error'].get('message')}"
            return
        for choice in event.get("choices") or ():
            if choice.get("text"):
                chunk_times.append(now)
            if choice.get("finish_reason"):
                record.finish_reason = choice["finish_reason"]
                if record.finish_reason == "abort":
                    record.error = "aborted by the server"
        usage = event.get("usage")
        if usage:
            record.output_tokens = int(usage.get("completion_tokens", 0))
            record.prompt_tokens = int(usage.get("prompt_tokens", 0)) or record.prompt_tokens
            record.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
