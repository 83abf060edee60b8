"""PushReceiver: the decode side of the gRPC transport, without gRPC (the servicer in grpc_servicer.py is thin).

Each Push stream is a PushSession: the first chunk's layout hash is checked before any byte is written,
then request and lease; every chunk's sequence number, pages (must belong to the lease), offset, size and
checksum are checked, and its payload is written straight into the pool pages (no buffering of the
request). Per (layer, page) byte counters catch gaps and overlaps. A failure fails the whole request
(every rank), calls on_failed(request_id) once, and later chunks of other streams for it are refused.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from engine.kv_cache import PagedLatentCache
from kvtransfer.checksum import Algorithm, digest
from kvtransfer.chunks import MAX_CHUNK_BYTES, WireChunk
from kvtransfer.destination import Destination, TransportKind, now_ms
from kvtransfer.errors import (
    BadChunk, ChecksumMismatch, IncompleteTransfer, KVTransferError, LayoutMismatch, TransferAborted,
    TransferTimeout, UnknownTransfer,
)
from kvtransfer.layout import SegmentKind, check_layout
from kvtransfer.leases import Lease
from kvtransfer.page_spans import cache_view, segment_offset
from kvtransfer.transport import KVReceiver, TransferResult
from pdserve.v1 import kv_pb2

logger = logging.getLogger(__name__)
_RECENT_FAILURES = 1024


class _Request:
    def __init__(self, destination: Destination, num_ranks: int) -> None:
        self.destination = destination
        self.page_index = {page: index for index, page in enumerate(destination.page_ids)}
        self.done_ranks: set[int] = set()
        self.open_ranks: set[int] = set()
        self.error: KVTransferError | None = None
        self.bytes = 0
        self.num_ranks = num_ranks
        self.lock = threading.Lock()  # held while writing pages: failing / cancelling waits for the write

    def set_error(self, error: KVTransferError) -> bool:
        """Marks the request failed (first error wins); returns whether this call did."""
        with self.lock:
            if self.error is not None:
                return False
            self.error = error
            return True


class PushReceiver(KVReceiver):
    """caches[r]: decode rank r's pool (an shm pool's .cache, or any PagedLatentCache over a flat buffer).
    addresses[r]: the address prefill must push rank r's pages to (set once the server is listening)."""

    transport = TransportKind.GRPC

    def __init__(self, caches: Sequence[PagedLatentCache], addresses: Sequence[str] = (), *,
                 on_failed: Callable[[str], None] | None = None) -> None:
        views = [cache_view(cache) for cache in caches]
        if not views or any(view[:2] != views[0][:2] for view in views):
            raise LayoutMismatch("PushReceiver needs at least one cache, all of the same layout and size")
        self.layout, self.num_pages = views[0][0], views[0][1]
        self._views = [view[2] for view in views]
        self.addresses = tuple(addresses)
        self.on_failed = on_failed
        self._lock = threading.Condition()
        self._requests: dict[str, _Request] = {}
        self._failures: dict[str, KVTransferError] = {}

    def advertise(self, addresses: Sequence[str]) -> None:
        if len(addresses) != len(self._views):
            raise ValueError(f"need one address per rank ({len(self._views)})")
        self.addresses = tuple(addresses)

    # --- KVReceiver -----------------------------------------------------------------------------------
    def expect(self, lease: Lease, num_tokens: int) -> Destination:
        if len(self.addresses) != len(self._views):
            raise ValueError("PushReceiver.advertise(addresses) must be called before expect()")
        destination = Destination(
            transport=self.transport, layout_hash=self.layout.hash, request_id=lease.request_id,
            lease_id=lease.lease_id, page_ids=lease.page_ids, targets=self.addresses,
            lease_deadline_unix_ms=lease.deadline_unix_ms, num_tokens=num_tokens, pool_num_pages=self.num_pages,
        )
        destination.check_against(self.layout, "PushReceiver.expect")
        if max(lease.page_ids) >= self.num_pages:
            raise ValueError(f"page {max(lease.page_ids)} outside the pool of {self.num_pages} pages")
        with self._lock:
            if lease.request_id in self._requests:
                raise ValueError(f"request {lease.request_id} is already expected")
            self._requests[lease.request_id] = _Request(destination, len(self._views))
            self._failures.pop(lease.request_id, None)
        return destination

    def admit(self, request_id: str, timeout_s: float = 0.0) -> TransferResult:
        with self._lock:
            request = self._requests.get(request_id)
            if request is None:
                raise self._failures.pop(request_id, None) or UnknownTransfer(f"no KV transfer expected for {request_id}")
            complete = lambda: request.error is not None or len(request.done_ranks) == request.num_ranks  # noqa: E731
            if not self._lock.wait_for(complete, timeout=timeout_s):
                raise TransferTimeout(f"KV of request {request_id} not complete after {timeout_s:.3f} s")
            if request.error is not None:
                self._failures.pop(request_id, None)
                raise request.error
            del self._requests[request_id]
        return TransferResult(request_id, request.bytes, 0, request.num_ranks)

    def cancel(self, request_id: str) -> None:
        with self._lock:
            request = self._requests.pop(request_id, None)
            if request is not None:
                request.set_error(TransferAborted(f"request {request_id} was cancelled"))
            self._failures.pop(request_id, None)
            self._lock.notify_all()

    def open_stream(self) -> PushSession:
        return PushSession(self)

    # --- used by sessions -----------------------------------------------------------------------------
    def _lookup(self, request_id: str, lease_id: str) -> _Request:
        with self._lock:
            request = self._requests.get(request_id)
        if request is None or request.destination.lease_id != lease_id:
            raise UnknownTransfer(f"no KV transfer expected for request {request_id!r} under lease {lease_id!r}")
        return request

    def _fail(self, request: _Request, error: KVTransferError) -> None:
        with self._lock:
            if not request.set_error(error):
                return
            request_id = request.destination.request_id
            if self._requests.get(request_id) is request:  # forget it; a later admit() raises the error
                del self._requests[request_id]
                self._failures[request_id] = error
                while len(self._failures) > _RECENT_FAILURES:
                    self._failures.pop(next(iter(self._failures)))
            self._lock.notify_all()
        logger.warning("KV push of request %s failed: %s", request.destination.request_id, error)
        if self.on_failed is not None:
            self.on_failed(request.destination.request_id)


class PushSession:
    """One Push stream (one request, one rank): apply() each chunk, then close()."""

    def __init__(self, receiver: PushReceiver) -> None:
        self.receiver = receiver
        self.request: _Request | None = None
        self.rank = -1
        self.sequence = 0
        self.bytes = 0
        self._coverage: list[list[int]] = []  # bytes received per segment, per page index
        self._segments = {segment: i for i, segment in enumerate(receiver.layout.segments())}

    def apply(self, chunk: WireChunk | kv_pb2.KVChunk) -> None:
        """Checks and writes one chunk (a decoded WireChunk, or a plain KVChunk message)."""
        header, payload = chunk if isinstance(chunk, WireChunk) else (chunk, chunk.payload)
        try:
            if self.request is None:
                self._begin(header)
            self._write(header, payload)
        except KVTransferError as error:
            self.abort(error)
            raise

    def _begin(self, chunk) -> None:
        receiver = self.receiver
        try:
            request = receiver._lookup(chunk.request_id, chunk.lease_id)
        except UnknownTransfer:
            request = None
        try:
            check_layout(receiver.layout, chunk.layout_hash, f"Push of request {chunk.request_id!r}")
        except LayoutMismatch:
            self.request = request  # refused before any byte moved; the request fails (pages freed)
            raise
        if request is None:
            raise UnknownTransfer(f"no KV transfer expected for request {chunk.request_id!r} under lease {chunk.lease_id!r}")
        self.request = request
        if not 0 <= chunk.rank < request.num_ranks:
            raise BadChunk(f"rank {chunk.rank} out of range (decode has {request.num_ranks})")
        with receiver._lock:
            if chunk.rank in request.open_ranks or chunk.rank in request.done_ranks:
                raise BadChunk(f"a second Push for request {chunk.request_id} rank {chunk.rank}")
            request.open_ranks.add(chunk.rank)
        self.rank = chunk.rank
        self._coverage = [[0] * len(request.page_index) for _ in self._segments]

    def _write(self, chunk: kv_pb2.KVChunk, payload) -> None:
        request, layout = self.request, self.receiver.layout
        dest = request.destination
        if (chunk.request_id and chunk.request_id != dest.request_id) or (chunk.lease_id and chunk.lease_id != dest.lease_id):
            raise BadChunk("a Push stream carries one request under one lease")
        if chunk.rank != self.rank or chunk.sequence != self.sequence:
            raise BadChunk(f"chunk rank {chunk.rank} sequence {chunk.sequence}, expected {self.rank} / {self.sequence}")
        if chunk.kind not in SegmentKind._value2member_map_ or (SegmentKind(chunk.kind), chunk.layer) not in self._segments:
            raise BadChunk(f"no segment kind {chunk.kind} layer {chunk.layer} in this layout")
        kind = SegmentKind(chunk.kind)
        page_bytes = layout.page_bytes(kind)
        indices = [request.page_index.get(page, -1) for page in chunk.page_ids]
        if not indices or min(indices) < 0:
            raise BadChunk(f"chunk pages {list(chunk.page_ids)} are not all in the lease of request {dest.request_id}")
        size, start = len(payload), chunk.first_page_offset
        if not 0 < size <= MAX_CHUNK_BYTES or start >= page_bytes or not (
            (len(indices) - 1) * page_bytes < start + size <= len(indices) * page_bytes
        ):
            raise BadChunk(f"chunk of {size} bytes at offset {start} does not fit {len(indices)} pages of {page_bytes}")
        if chunk.checksum_algorithm not in Algorithm._value2member_map_:
            raise BadChunk(f"unknown checksum algorithm {chunk.checksum_algorithm}")
        if digest(payload, Algorithm(chunk.checksum_algorithm)) != chunk.checksum:
            raise ChecksumMismatch(f"request {dest.request_id} rank {self.rank} chunk {chunk.sequence}: checksum mismatch")
        dest.check_lease()
        segment = self._segments[(kind, chunk.layer)]
        base = segment_offset(layout, self.receiver.num_pages, kind, chunk.layer)
        coverage, copies = self._coverage[segment], []  # copies: [pool offset, payload offset, nbytes]
        position, offset = 0, start
        for page, index in zip(chunk.page_ids, indices):
            take = min(page_bytes - offset, size - position)
            if coverage[index] + take > page_bytes:
                raise BadChunk(f"page {page} of {kind.name.lower()} layer {chunk.layer} written twice")
            coverage[index] += take
            target = base + page * page_bytes + offset
            if copies and copies[-1][0] + copies[-1][2] == target:  # consecutive pool pages: one memcpy
                copies[-1][2] += take
            else:
                copies.append([target, position, take])
            position, offset = position + take, 0
        view, source = self.receiver._views[self.rank], memoryview(payload)
        with request.lock:  # cancel() / a failure on another stream cannot free the pages mid-write
            if request.error is not None:
                raise TransferAborted(f"request {dest.request_id} already failed: {request.error}")
            for target, position, take in copies:
                view[target : target + take] = source[position : position + take]
        self.sequence += 1
        self.bytes += size

    def close(self) -> int:
        """End of stream: every page of every layer must have arrived; returns the bytes written."""
        try:
            if self.request is None:
                raise BadChunk("empty Push stream")
            layout, pages = self.receiver.layout, len(self.request.page_index)
            for (kind, layer), coverage in zip(self._segments, self._coverage):
                if any(count != layout.page_bytes(kind) for count in coverage):
                    raise IncompleteTransfer(
                        f"request {self.request.destination.request_id} rank {self.rank}: short write, "
                        f"{kind.name.lower()} layer {layer} has {sum(coverage)} of {pages * layout.page_bytes(kind)} bytes"
                        f" ({self.bytes} of {pages * layout.bytes_per_page} in all)"
                    )
        except KVTransferError as error:
            self.abort(error)
            raise
        with self.receiver._lock:
            request = self.request
            if request.error is not None:
                raise TransferAborted(f"request {request.destination.request_id} already failed: {request.error}")
            request.open_ranks.discard(self.rank)
            request.done_ranks.add(self.rank)
            request.bytes += self.bytes
            self.receiver._lock.notify_all()
        return self.bytes

    def abort(self, error: KVTransferError) -> None:
        """Fails the request this stream belongs to (no-op before the request is known)."""
        if self.request is not None:
            self.receiver._fail(self.request, error)
