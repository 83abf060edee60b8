"""gRPC Prefill servicer: protobuf <-> PrefillService calls, nothing else."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from engine.sampling_params import SamplingParams
from kvtransfer.destination import Destination
from rpc.convert import load_method, logprob_to_proto, sampling_fields
from rpc.status import InvalidArgument, parse_field, unary
from rpc.internal.v1 import worker_pb2, worker_pb2_grpc
from rpc.stream_sessions import StreamSessions
from prefill_worker.prefill_stream import PrefillSession
from prefill_worker.service import PrefillService


class PrefillServicer(worker_pb2_grpc.PrefillServiceServicer):
    def __init__(self, service: PrefillService) -> None:
        self._service = service
        self._streams = StreamSessions()

    async def PrefillStream(self, requests: AsyncIterator[worker_pb2.PrefillStreamRequest],
                            context: grpc.aio.ServicerContext) -> None:
        await self._streams.serve(PrefillSession(context, self._prefill), requests, context)

    def drain(self) -> None:
        """Shutdown began: open PrefillStreams take no new prompts and end once theirs are answered."""
        self._streams.drain()

    async def _prefill(self, request: worker_pb2.PrefillRequest, reply_sent: asyncio.Event) -> worker_pb2.PrefillResponse:
        """One prompt: reply_sent is set by the caller once its reply is out (the KV's completion record waits
        for it: see PrefillService)."""
        params = parse_field("sampling", SamplingParams, **sampling_fields(request.sampling))
        if not request.HasField("destination"):
            raise InvalidArgument("destination", "is required")
        destination = parse_field("destination", Destination.from_proto, request.destination)
        outcome = await self._service.prefill(request.request_id, list(request.token_ids), params, destination,
                                              reply_sent)
        response = worker_pb2.PrefillResponse(
            first_token=outcome.first_token, num_prompt_tokens=outcome.num_prompt_tokens,
            num_cached_tokens=outcome.num_cached_tokens,
            timing=worker_pb2.PrefillTiming(queue_ms=outcome.queue_ms, prefill_ms=outcome.prefill_ms,
                                            transfer_ms=outcome.transfer_ms),
        )
        if outcome.first_logprob is not None:
            response.first_logprob.CopyFrom(logprob_to_proto(outcome.first_logprob))
        response.prompt_logprobs.extend(logprob_to_proto(logprob) for logprob in outcome.prompt_logprobs)
        return response

    @unary
    async def Cancel(self, request: worker_pb2.CancelRequest, context: grpc.aio.ServicerContext) -> worker_pb2.CancelResponse:
        return worker_pb2.CancelResponse(dropped=await self._service.cancel(request.request_id))

    GetPrefillLoad = load_method(worker_pb2.GetPrefillLoadResponse, "device")
