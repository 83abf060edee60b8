"""One KVTransferService.Push stream on the decode side: checks each chunk and writes it into the pool pages.

The first chunk's layout hash is checked before any byte is written, then request and lease; every chunk's
sequence number, pages (all in the lease), offset, size and checksum are checked, then its payload is
copied straight into the pool (no buffering of the request). Per (layer, page) byte ranges catch overlaps
(a byte written twice is refused, even when the count would add up) and gaps; close() requires every byte of
every page of every layer. Any failure fails the whole request.
"""
from __future__ import annotations

import bisect
import threading
from typing import Protocol

from kvtransfer.checksum import Algorithm, digest
from kvtransfer.chunks import MAX_CHUNK_BYTES, WireChunk, kind_from_wire
from kvtransfer.destination import Destination
from kvtransfer.errors import (
    BadChunk, ChecksumMismatch, IncompleteTransfer, KVTransferError, LayoutMismatch, TransferAborted, UnknownTransfer,
)
from kvtransfer.layout import KVLayout, SegmentKind, check_layout
from kvtransfer.page_spans import segment_offset
from rpc.internal.v1 import kv_pb2


class PendingPush:
    """A request the receiver expects: its pages, which ranks have streamed it, and whether it failed."""

    def __init__(self, destination: Destination, num_ranks: int) -> None:
        self.destination = destination
        self.page_index = {page: index for index, page in enumerate(destination.page_ids)}
        self.state_index = {destination.state_slot: 0} if destination.state_slot is not None else {}
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


class PageCoverage:
    """The byte ranges of one page received so far: sorted, disjoint, adjacent ones merged."""

    __slots__ = ("ranges",)

    def __init__(self) -> None:
        self.ranges: list[list[int]] = []  # [start, end) pairs

    def add(self, start: int, end: int) -> bool:
        """Records [start, end); False (and nothing recorded) if any byte of it was already received."""
        at = bisect.bisect_right(self.ranges, [start, end])
        if (at > 0 and self.ranges[at - 1][1] > start) or (at < len(self.ranges) and self.ranges[at][0] < end):
            return False
        if at > 0 and self.ranges[at - 1][1] == start:
            self.ranges[at - 1][1] = end
            at -= 1
        else:
            self.ranges.insert(at, [start, end])
        if at + 1 < len(self.ranges) and self.ranges[at + 1][0] == end:
            self.ranges[at][1] = self.ranges.pop(at + 1)[1]
        return True

    @property
    def received(self) -> int:
        return sum(end - start for start, end in self.ranges)

    def complete(self, page_bytes: int) -> bool:
        return self.ranges == [[0, page_bytes]]


class SessionHost(Protocol):
    """What a push session uses of its receiver (grpc_receiver.PushReceiver): the pool's layout and size, the
    expected requests, each rank's pool view, and the bookkeeping of a rank's stream."""

    layout: KVLayout
    num_pages: int

    def view(self, rank: int) -> memoryview: ...
    def lookup(self, request_id: str, lease_id: str) -> PendingPush: ...
    def open_rank(self, request: PendingPush, rank: int) -> None: ...
    def close_rank(self, request: PendingPush, rank: int, nbytes: int) -> None: ...
    def fail(self, request: PendingPush, error: KVTransferError) -> None: ...


class PushSession:
    """One Push stream (one request, one rank): apply() each chunk, then close()."""

    def __init__(self, receiver: SessionHost) -> None:
        self.receiver = receiver
        self.request: PendingPush | None = None
        self.rank = -1
        self.sequence = 0
        self.bytes = 0
        self._coverage: list[list[PageCoverage]] = []  # byte ranges received per segment, per page index
        self._segments = {segment: i for i, segment in enumerate(receiver.layout.segments())}

    def apply(self, chunk: WireChunk | kv_pb2.PushRequest) -> None:
        """Checks and writes one chunk (a decoded WireChunk, or a plain PushRequest message)."""
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
            request = receiver.lookup(chunk.request_id, chunk.lease_id)
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
        receiver.open_rank(request, chunk.rank)
        self.rank = chunk.rank
        self._coverage = [[PageCoverage() for _ in self._index(request, kind)] for kind, _ in self._segments]

    @staticmethod
    def _index(request: PendingPush, kind: SegmentKind) -> dict[int, int]:
        """Unit id -> index in the request, for a segment kind: its pages, or (STATE) its state slot."""
        return request.state_index if kind == SegmentKind.STATE else request.page_index

    def _write(self, chunk: kv_pb2.PushRequest, payload) -> None:
        request, layout = self.request, self.receiver.layout
        dest = request.destination
        if (chunk.request_id and chunk.request_id != dest.request_id) or (chunk.lease_id and chunk.lease_id != dest.lease_id):
            raise BadChunk("a Push stream carries one request under one lease")
        if chunk.rank != self.rank or chunk.sequence != self.sequence:
            raise BadChunk(f"chunk rank {chunk.rank} sequence {chunk.sequence}, expected {self.rank} / {self.sequence}")
        kind = kind_from_wire(chunk.kind)
        if kind is None or (kind, chunk.layer) not in self._segments:
            raise BadChunk(f"no segment kind {chunk.kind} layer {chunk.layer} in this layout")
        page_bytes = layout.page_bytes(kind)
        indices = [self._index(request, kind).get(page, -1) for page in chunk.page_ids]
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
            if not coverage[index].add(offset, offset + take):
                raise BadChunk(f"page {page} of {kind.name.lower()} layer {chunk.layer}: bytes {offset}..{offset + take}"
                               " written twice")
            target = base + page * page_bytes + offset
            if copies and copies[-1][0] + copies[-1][2] == target:  # consecutive pool pages: one memcpy
                copies[-1][2] += take
            else:
                copies.append([target, position, take])
            position, offset = position + take, 0
        view, source = self.receiver.view(self.rank), memoryview(payload)
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
                if not all(page.complete(layout.page_bytes(kind)) for page in coverage):
                    raise IncompleteTransfer(
                        f"request {self.request.destination.request_id} rank {self.rank}: short write, "
                        f"{kind.name.lower()} layer {layer} has {sum(page.received for page in coverage)} of "
                        f"{len(coverage) * layout.page_bytes(kind)} bytes"
                        f" ({self.bytes} of {layout.request_bytes(pages)} in all)"
                    )
        except KVTransferError as error:
            self.abort(error)
            raise
        self.receiver.close_rank(self.request, self.rank, self.bytes)
        return self.bytes

    def abort(self, error: KVTransferError) -> None:
        """Fails the request this stream belongs to (no-op before the request is known)."""
        if self.request is not None:
            self.receiver.fail(self.request, error)
