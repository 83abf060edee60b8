"""Client helpers over the public API: build a GenerateRequest, stream it, collect the result."""
from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import grpc

from rpc.convert import finish_reason_name, set_given
from rpc.v1 import gateway_pb2, gateway_pb2_grpc, logprobs_pb2


def build_request(prompt: str | Sequence[int], *, max_tokens: int | None = None, temperature: float | None = None,
                  top_p: float | None = None, top_k: int | None = None, seed: int | None = None,
                  stop: Sequence[str] = (), stop_token_ids: Sequence[int] = (), ignore_eos: bool = False,
                  speculative: bool | None = None, block_size: int | None = None, top_logprobs: int | None = None,
                  request_id: str = "", stream_interval: int | None = None) -> gateway_pb2.GenerateRequest:
    """A text prompt (str) or token ids; None leaves a field unset (the server's default applies)."""
    request = gateway_pb2.GenerateRequest(request_id=request_id, stop=list(stop), stop_token_ids=list(stop_token_ids),
                                          ignore_eos=ignore_eos)
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.ids.extend(prompt)
    optional = {"max_tokens": max_tokens, "speculative": speculative, "block_size": block_size,
                "top_logprobs": top_logprobs, "stream_interval": stream_interval}
    set_given(request, optional, optional)
    sampling = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "seed": seed}
    set_given(request.sampling, sampling, sampling)
    return request


@dataclass
class Completion:
    """Everything one Generate stream returned."""

    request_id: str = ""
    token_ids: list[int] = field(default_factory=list)
    deltas: list[str] = field(default_factory=list)
    chunk_sizes: list[int] = field(default_factory=list)  # token ids per chunk, in order
    logprobs: list[logprobs_pb2.TokenLogprob] = field(default_factory=list)
    complete: gateway_pb2.Complete | None = None
    error: gateway_pb2.Error | None = None

    @property
    def text(self) -> str:
        return "".join(self.deltas)

    @property
    def finish_reason(self) -> str:
        return finish_reason_name(self.complete.finish_reason) if self.complete else ""


async def stream(stub: gateway_pb2_grpc.GatewayServiceStub, request: gateway_pb2.GenerateRequest,
                 timeout: float | None = None, metadata: Sequence[tuple[str, str]] | None = None,
                 ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
    """The raw responses; raises grpc.aio.AioRpcError on a non-OK status. metadata: e.g. an API key
    as (("authorization", "Bearer <key>"),)."""
    async for response in stub.Generate(request, timeout=timeout, metadata=metadata):
        yield response


async def generate(stub: gateway_pb2_grpc.GatewayServiceStub, request: gateway_pb2.GenerateRequest,
                   timeout: float | None = None, metadata: Sequence[tuple[str, str]] | None = None) -> Completion:
    """Collects a whole stream. An Error message is kept in .error (the status error is swallowed then)."""
    result = Completion()
    try:
        async for response in stream(stub, request, timeout, metadata):
            result.request_id = response.request_id
            kind = response.WhichOneof("kind")
            if kind == "chunk":
                result.token_ids.extend(response.chunk.token_ids)
                result.deltas.append(response.chunk.text)
                result.chunk_sizes.append(len(response.chunk.token_ids))
                result.logprobs.extend(response.chunk.logprobs)
            elif kind == "complete":
                result.complete = response.complete
            elif kind == "error":
                result.error = response.error
    except grpc.aio.AioRpcError:
        if result.error is None:
            raise
    return result
