"""The gateway as the benchmark sees it: model info, and one streamed request -> RequestRecord."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import grpc

from bench.config import SamplingOptions
from bench.record import RequestRecord
from bench.workload import BenchRequest
from rpc.convert import finish_reason_name, set_given
from rpc.v1 import gateway_pb2, gateway_pb2_grpc


class GatewayUnreachable(RuntimeError):
    """No gateway answered at the address in time; the message is one line."""


@dataclass(frozen=True)
class ModelSummary:
    model: str
    vocab_size: int
    max_context: int
    eos_token_ids: frozenset[int]


def build_request(request: BenchRequest, options: SamplingOptions) -> gateway_pb2.GenerateRequest:
    message = gateway_pb2.GenerateRequest(max_tokens=request.output_len, ignore_eos=request.ignore_eos)
    if request.token_ids:
        message.token_ids.ids.extend(request.token_ids)
    else:
        message.text = request.text
    set_given(message.sampling, options, ("temperature", "top_p", "top_k"))
    set_given(message, options, ("speculative", "block_size", "stream_interval"))
    return message


class GatewayClient:
    """Wraps one shared grpc.aio channel; `send` never raises for RPC failures (they become record.error)."""

    def __init__(self, channel: grpc.aio.Channel, options: SamplingOptions = SamplingOptions()) -> None:
        self._stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        self._channel = channel
        self.options = options

    async def model_info(self, address: str, timeout_s: float) -> ModelSummary:
        """Waits up to timeout_s for the channel, then asks GetModelInfo with the same deadline."""
        try:
            await asyncio.wait_for(self._channel.channel_ready(), timeout_s)
            info = await self._stub.GetModelInfo(gateway_pb2.GetModelInfoRequest(), timeout=timeout_s)
        except asyncio.TimeoutError:
            raise GatewayUnreachable(f"no gateway answered at {address} within {timeout_s:g} s") from None
        except grpc.aio.AioRpcError as error:
            raise GatewayUnreachable(
                f"gateway at {address} did not answer GetModelInfo: {error.code().name}: {error.details()}"
            ) from None
        return ModelSummary(info.model, info.vocab_size, info.max_context, frozenset(info.eos_token_ids))

    async def send(self, request: BenchRequest) -> RequestRecord:
        record = RequestRecord.of(request)
        chunk_times: list[float] = []
        chunk_tokens: list[int] = []
        start = time.perf_counter()
        try:
            call = self._stub.Generate(build_request(request, self.options), timeout=self.options.timeout_s)
            async for response in call:
                now = time.perf_counter() - start
                kind = response.WhichOneof("kind")
                if kind == "chunk":
                    chunk_times.append(now)
                    chunk_tokens.append(len(response.chunk.token_ids))
                    record.output_token_ids.extend(response.chunk.token_ids)
                elif kind == "complete":
                    _fill_complete(record, response.complete, now)
                elif kind == "error":
                    record.error = f"{_status_name(response.error.code)}: {response.error.message}"
        except grpc.aio.AioRpcError as error:
            if not record.error:
                record.error = f"{error.code().name}: {error.details()}"
        record.output_tokens = sum(chunk_tokens)
        first = next((time for time, count in zip(chunk_times, chunk_tokens) if count > 0), None)
        record.ttft_s = first if first is not None else 0.0
        record.end_stream(chunk_times, chunk_tokens, "a Complete message")
        return record


def _fill_complete(record: RequestRecord, complete: gateway_pb2.Complete, now: float) -> None:
    record.e2e_s = now
    record.finish_reason = finish_reason_name(complete.finish_reason)
    if complete.finish_reason == gateway_pb2.Complete.FINISH_REASON_ABORT:
        record.error = "aborted by the server"
    if complete.usage.prompt_tokens > 0:
        record.prompt_tokens = complete.usage.prompt_tokens
    record.cached_tokens = complete.usage.cached_tokens
    if complete.HasField("acceptance") and complete.acceptance.verify_steps > 0:
        record.accept_length = complete.acceptance.mean_accepted_tokens


def _status_name(code: int) -> str:
    return next((status.name for status in grpc.StatusCode if status.value[0] == code), f"status {code}")
