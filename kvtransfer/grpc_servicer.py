"""KVTransfer servicers (sync and asyncio): thin wrappers over PushReceiver. Refusals become gRPC status
through rpc.status, the one mapper (each KVTransferError names its own grpc_status: LayoutMismatch ->
FAILED_PRECONDITION, UnknownTransfer / LeaseExpired -> NOT_FOUND, BadChunk -> INVALID_ARGUMENT,
ChecksumMismatch / IncompleteTransfer -> DATA_LOSS, TransferAborted -> ABORTED)."""
from __future__ import annotations

import logging
from concurrent import futures

import grpc

from kvtransfer.chunks import decode_chunk
from kvtransfer.errors import KVTransferError, TransferAborted
from kvtransfer.grpc_receiver import PushReceiver
from rpc.status import abort, status_of
from rpc.internal.v1 import kv_pb2, kv_pb2_grpc

SERVICE = "pdserve.internal.v1.KVTransferService"

logger = logging.getLogger(__name__)


class _PushCall:
    """One Push call's session; leaving the block before finish() (client gone, refused chunk, unexpected
    error) fails the request, so it does not linger."""

    def __init__(self, receiver: PushReceiver) -> None:
        self.session = receiver.open_stream()
        self._finished = False

    def finish(self) -> kv_pb2.PushResponse:
        nbytes = self.session.close()
        self._finished = True
        return kv_pb2.PushResponse(ok=True, bytes=nbytes, chunks=self.session.sequence)

    def __enter__(self) -> _PushCall:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if not self._finished:
            self.session.abort(TransferAborted("the Push stream ended early"))


class KVTransferServicer(kv_pb2_grpc.KVTransferServiceServicer):
    """For a grpc.server (thread pool): each Push runs in its own worker thread."""

    def __init__(self, receiver: PushReceiver) -> None:
        self.receiver = receiver

    def Push(self, request_iterator, context):  # noqa: N802 - gRPC method name
        with _PushCall(self.receiver) as call:
            try:
                for chunk in request_iterator:
                    call.session.apply(chunk)
                return call.finish()
            except KVTransferError as error:
                logger.info("KV Push refused: %s", error)
                context.abort_with_status(status_of(error))


class KVTransferAioServicer(kv_pb2_grpc.KVTransferServiceServicer):
    """For a grpc.aio.server. Each chunk is checked and copied inline (~100 us per MiB)."""

    def __init__(self, receiver: PushReceiver) -> None:
        self.receiver = receiver

    async def Push(self, request_iterator, context):  # noqa: N802 - gRPC method name
        with _PushCall(self.receiver) as call:
            try:
                async for chunk in request_iterator:
                    call.session.apply(chunk)
                return call.finish()
            except KVTransferError as error:
                logger.info("KV Push refused: %s", error)
                await abort(context, status_of(error))


def add_to_server(receiver: PushReceiver, server) -> None:
    """Registers KVTransfer on a grpc.server or grpc.aio.server, decoding chunks with kvtransfer.chunks
    (payloads stay views of the received bytes) instead of the generated add_KVTransferServiceServicer_to_server."""
    aio = isinstance(server, grpc.aio.Server)
    servicer = KVTransferAioServicer(receiver) if aio else KVTransferServicer(receiver)
    handler = grpc.stream_unary_rpc_method_handler(
        servicer.Push, request_deserializer=decode_chunk, response_serializer=kv_pb2.PushResponse.SerializeToString
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {"Push": handler}),))


def serve(receiver: PushReceiver, address: str = "127.0.0.1:0", max_workers: int = 16) -> tuple[grpc.Server, int]:
    """Starts a standalone sync KVTransfer server (tests, benchmarks); returns (server, bound port)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers))
    add_to_server(receiver, server)
    port = server.add_insecure_port(address)
    server.start()
    return server, port
