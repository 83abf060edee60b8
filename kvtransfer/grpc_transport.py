"""gRPC transport, prefill side: stream a request's pages layer-major into KVTransferService.Push of decode rank r.

Memory stays bounded: push() builds each <= 1 MiB chunk only when gRPC asks for the next one; a
write handle hands chunks to the call through a queue of queue_depth chunks (write_pages blocks when full).
"""
from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence

import grpc
import torch

from engine.cache.kv_cache import PagedLatentCache
from kvtransfer import errors
from kvtransfer.checksum import DEFAULT_ALGORITHM, Algorithm
from kvtransfer.chunks import MAX_CHUNK_BYTES, ChunkEncoder, encode_chunk
from kvtransfer.destination import Destination, TransportKind
from kvtransfer.errors import (
    BadChunk, ChecksumMismatch, KVTransferError, LayoutMismatch, OutOfSlots, TransferAborted, TransferTimeout,
    UnknownTransfer,
)
from kvtransfer.layout import KVLayout, SegmentKind
from kvtransfer.page_spans import byte_view, cache_view, segment_offset, unit_ids
from kvtransfer.transport import KVWriteHandle, KVWriter, TransferResult
from rpc.status import error_reason

logger = logging.getLogger(__name__)
PUSH_METHOD = "/pdserve.internal.v1.KVTransferService/Push"

_ERROR_FOR_CODE = {
    grpc.StatusCode.FAILED_PRECONDITION: LayoutMismatch,
    grpc.StatusCode.NOT_FOUND: UnknownTransfer,
    grpc.StatusCode.INVALID_ARGUMENT: BadChunk,
    grpc.StatusCode.DATA_LOSS: ChecksumMismatch,
    grpc.StatusCode.ABORTED: TransferAborted,
    grpc.StatusCode.DEADLINE_EXCEEDED: TransferTimeout,
    grpc.StatusCode.RESOURCE_EXHAUSTED: OutOfSlots,
}


def error_from_rpc(error: grpc.RpcError) -> KVTransferError:
    """The kvtransfer exception for a failed Push: the class the server raised (its ErrorInfo names it),
    else the one its status code stands for; the message is the server's."""
    code = error.code()
    kind = _ERROR_FOR_CODE.get(code, KVTransferError)
    named = error_reason(error)
    if named is not None and named[0] == errors.__name__:
        raised = getattr(errors, named[1], None)
        if isinstance(raised, type) and issubclass(raised, KVTransferError):
            kind = raised
    return kind(f"Push failed with {code.name}: {error.details()}")


class _PushStub:
    def __init__(self, push, metadata: tuple[tuple[str, str], ...] = ()) -> None:
        self.Push = push
        self.metadata = metadata


class GrpcWriteHandle(KVWriteHandle):
    """Streams chunks as write_pages() produces them; finish() closes the stream and waits for the result."""

    _END = object()

    def __init__(self, stub, destination: Destination, rank: int, layout: KVLayout, algorithm: Algorithm,
                 max_chunk: int, queue_depth: int, timeout_s: float) -> None:
        super().__init__(destination, rank, layout)
        self._encoder = ChunkEncoder(destination, rank, layout, max_chunk, algorithm)
        self._queue: queue.Queue = queue.Queue(maxsize=queue_depth)
        self._future = stub.Push.future(self._requests(), timeout=timeout_s, metadata=stub.metadata)

    def _requests(self):
        while True:
            item = self._queue.get()
            if item is self._END:
                return
            yield item

    def _send(self, item) -> None:
        while True:
            try:
                self._queue.put(item, timeout=0.05)
                return
            except queue.Full:
                if self._future.done():  # the server refused the stream: stop producing
                    self._future.result()

    def write_pages(self, kind: SegmentKind, layer: int, first_index: int, data: torch.Tensor) -> None:
        self.check_data(kind, layer, first_index, data)
        page_bytes = self.layout.page_bytes(kind)
        # Queued chunks are views of data: it must not change until finish() (a change fails the chunk checksum).
        view = byte_view(data.contiguous())
        try:
            for chunk in self._encoder.encode(kind, layer, first_index, view, range(0, len(view), page_bytes)):
                self._send(chunk)
        except grpc.RpcError as error:
            self.done = True
            raise error_from_rpc(error) from error

    def finish(self) -> TransferResult:
        self.done = True
        try:
            self._send(self._END)
            result = self._future.result()
        except grpc.RpcError as error:
            raise error_from_rpc(error) from error
        return TransferResult(self.destination.request_id, result.bytes)

    def abort(self, reason: str) -> None:
        if not self.done:
            self.done = True
            logger.warning("aborting grpc KV push of request %s rank %d: %s", self.destination.request_id, self.rank, reason)
            self._future.cancel()


class GrpcWriter(KVWriter):
    """Prefill side: one channel per decode address, reused by every request."""

    def __init__(self, layout: KVLayout, *, max_chunk: int = MAX_CHUNK_BYTES, algorithm: Algorithm = DEFAULT_ALGORITHM,
                 timeout_s: float = 120.0, queue_depth: int = 8, metadata: tuple[tuple[str, str], ...] = ()) -> None:
        """metadata: sent with every Push (the internal token, when the decode worker requires one)."""
        self.layout = layout
        self.metadata = tuple(metadata)
        self.max_chunk = max_chunk
        self.algorithm = Algorithm(algorithm)
        self.timeout_s = timeout_s
        self.queue_depth = queue_depth
        self._channels: dict[str, tuple[grpc.Channel, _PushStub]] = {}
        self._lock = threading.Lock()

    def stub(self, address: str) -> _PushStub:
        """Push with the chunk codec of kvtransfer.chunks (the payload never enters a protobuf object)."""
        from rpc.internal.v1 import kv_pb2

        with self._lock:
            if address not in self._channels:
                channel = grpc.insecure_channel(address)
                push = channel.stream_unary(
                    PUSH_METHOD, request_serializer=encode_chunk, response_deserializer=kv_pb2.PushResponse.FromString
                )
                self._channels[address] = (channel, _PushStub(push, self.metadata))
            return self._channels[address][1]

    def _check(self, destination: Destination) -> None:
        if destination.transport != TransportKind.GRPC:
            raise BadChunk(f"GrpcWriter cannot write a {destination.transport.name} destination")
        destination.check_against(self.layout, f"grpc writer for request {destination.request_id}")
        destination.check_lease()

    def open(self, destination: Destination, rank: int = 0) -> GrpcWriteHandle:
        self._check(destination)
        return GrpcWriteHandle(self.stub(destination.target(rank)), destination, rank, self.layout, self.algorithm,
                               self.max_chunk, self.queue_depth, self.timeout_s)

    def push(self, cache: PagedLatentCache, source_page_ids: Sequence[int], destination: Destination,
             rank: int = 0, source_state_slot: int | None = None) -> TransferResult:
        """Streams the request's pages (and, with linear-attention state, the cache's state slot
        source_state_slot) straight from the local cache: each chunk is built when gRPC pulls it."""
        layout, num_pages, view = cache_view(cache)
        if layout != self.layout:
            raise LayoutMismatch(f"local cache layout {layout.hash} is not the writer's {self.layout.hash}")
        self._check(destination)
        if len(source_page_ids) != len(destination.page_ids):
            raise BadChunk(f"{len(source_page_ids)} source pages for {len(destination.page_ids)} destination pages")
        encoder = ChunkEncoder(destination, rank, layout, self.max_chunk, self.algorithm)
        stopped: list[KVTransferError] = []

        def chunks():
            try:
                for kind, layer in layout.segments():
                    base, page_bytes = segment_offset(layout, num_pages, kind, layer), layout.page_bytes(kind)
                    sources = unit_ids(kind, source_page_ids, source_state_slot)
                    yield from encoder.encode(kind, layer, 0, view, [base + page * page_bytes for page in sources])
            except KVTransferError as error:  # e.g. the lease expired mid-stream: end it, report this error
                stopped.append(error)

        try:
            result = self.stub(destination.target(rank)).Push(chunks(), timeout=self.timeout_s)
        except grpc.RpcError as error:
            raise (stopped[0] if stopped else error_from_rpc(error)) from error
        if stopped:
            raise stopped[0]
        return TransferResult(destination.request_id, result.bytes)

    def close(self) -> None:
        with self._lock:
            channels, self._channels = self._channels, {}
        for channel, _ in channels.values():
            channel.close()
