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
from kvtransfer.grpc_receiver import PushReceiver, PushSession
from rpc.status import abort, status_of
from rpc.internal.v1 import kv_pb2, kv_pb2_grpc

SERVICE = "pdserve.internal.v1.KVTransferService"

logger = logging.getLogger(__name__)


def _result(session: PushSession, nbytes: int) -> kv_pb2.PushResponse:
    return kv_pb2.PushResponse(ok=True, bytes=nbytes, chunks=session.sequence)


class KVTransferServicer(kv_pb2_grpc.KVTransferServiceServicer):
    """For a grpc.server (thread pool): each Push runs in its own worker thread."""

    def __init__(self, receiver: PushReceiver) -> None:
        self.receiver = receiver

    def Push(self, request_iterator, context):  # noqa: N802 - gRPC method name
        session = self.receiver.open_stream()
        finished = False
        try:
            for chunk in request_iterator:
                session.apply(chunk)
            nbytes = session.close()
            finished = True
            return _result(session, nbytes)
        except KVTransferError as error:
            logger.info("KV Push refused: %s", error)
            context.abort_with_status(status_of(error))
        finally:
            if not finished:  # client went away, or an unexpected error: the request must not linger
                session.abort(TransferAborted("the Push stream ended early"))


class KVTransferAioServicer(kv_pb2_grpc.KVTransferServiceServicer):
    """For a grpc.aio.server. Each chunk is checked and copied inline (~100 us per MiB)."""

    def __init__(self, receiver: PushReceiver) -> None:
        self.receiver = receiver

    async def Push(self, request_iterator, context):  # noqa: N802 - gRPC method name
        session = self.receiver.open_stream()
        finished = False
        try:
            async for chunk in request_iterator:
                session.apply(chunk)
            nbytes = session.close()
            finished = True
            return _result(session, nbytes)
        except KVTransferError as error:
            logger.info("KV Push refused: %s", error)
            await abort(context, status_of(error))
        finally:
            if not finished:
                session.abort(TransferAborted("the Push stream ended early"))


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
