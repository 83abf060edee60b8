"""gRPC Decode servicer: protobuf <-> DecodeService calls, nothing else."""
from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from decode_worker.decode_stream import DecodeSession
from decode_worker.service import DecodeService
from decode_worker.streams import Sink
from engine.sampling_params import SamplingParams
from kvtransfer.destination import TransportKind
from rpc.convert import load_method, sampling_fields
from rpc.status import InvalidArgument, parse_field, unary
from rpc.internal.v1 import kv_pb2, worker_pb2, worker_pb2_grpc
from rpc.stream_sessions import StreamSessions


def transport_from_proto(value: int) -> TransportKind:
    """TRANSPORT_UNSPECIFIED means shared memory (the same-host default)."""
    if value == kv_pb2.TRANSPORT_UNSPECIFIED:
        return TransportKind.SHM
    try:
        return TransportKind(value)
    except ValueError as error:
        raise InvalidArgument("transport", f"unknown transport {value}") from error


class DecodeServicer(worker_pb2_grpc.DecodeServiceServicer):
    def __init__(self, service: DecodeService) -> None:
        self._service = service
        self._streams = StreamSessions()

    @unary
    async def Reserve(self, request: worker_pb2.ReserveRequest, context: grpc.aio.ServicerContext) -> worker_pb2.ReserveResponse:
        destination = await self._service.reserve(
            request.request_id, request.num_prompt_tokens, request.max_new_tokens,
            transport_from_proto(request.transport), ttl_s=context.time_remaining(), standing=request.standing,
            prompt_ids=list(request.prompt_token_ids),
        )

        def on_done(done: grpc.aio.ServicerContext) -> None:  # the answer was lost (deadline, cancel)
            if done.cancelled():
                self._service.abandon(destination.request_id, destination.lease_id)

        context.add_done_callback(on_done)
        return worker_pb2.ReserveResponse(destination=destination.to_proto())

    async def DecodeStream(self, requests: AsyncIterator[worker_pb2.DecodeStreamRequest],
                           context: grpc.aio.ServicerContext) -> None:
        await self._streams.serve(DecodeSession(context, self._run, self._service.release_soon), requests, context)

    def drain(self) -> None:
        """Shutdown began: open DecodeStreams take no new requests and end once theirs have finished."""
        self._streams.drain()

    async def _run(self, request: worker_pb2.DecodeRequest, sink: Sink) -> None:
        """One request, its updates to sink, until it ends (raises InvalidArgument for bad sampling settings)."""
        params = parse_field("sampling", SamplingParams, **sampling_fields(request.sampling))
        await self._service.run_decode(request.request_id, request.lease_id, list(request.token_ids),
                                       request.first_token, params, request.stream_interval, sink,
                                       local=request.prefill_locally)

    @unary
    async def Release(self, request: worker_pb2.ReleaseRequest, context: grpc.aio.ServicerContext) -> worker_pb2.ReleaseResponse:
        return worker_pb2.ReleaseResponse(found=await self._service.release(request.request_id))

    GetDecodeLoad = load_method(worker_pb2.GetDecodeLoadResponse, "device", "kv_pool")
