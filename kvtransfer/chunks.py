"""PushRequest framing for the gRPC transport: cutting a request's pages into <= 1 MiB chunks, and a wire codec
that keeps the payload out of protobuf (no copies into / out of message objects).

On the wire a chunk is an ordinary serialized PushRequest: the small header fields, then field 10 (payload)
appended by hand. encode_chunk joins header and payload pieces (views of the pages) in one copy;
decode_chunk parses the header with protobuf and returns the payload as a view of the received bytes.
Any standard PushRequest encoding decodes, so the generated stub works as a client too.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import NamedTuple

from kvtransfer.checksum import DEFAULT_ALGORITHM, Algorithm, Hasher, digest
from kvtransfer.destination import Destination
from kvtransfer.layout import KVLayout, SegmentKind
from rpc.internal.v1 import kv_pb2
from rpc.wire import encode_varint, iter_fields, read_varint

MAX_CHUNK_BYTES = 1 << 20  # well under gRPC's 4 MiB default message limit, whatever the prompt length
PAYLOAD_FIELD = kv_pb2.PushRequest.DESCRIPTOR.fields_by_name["payload"].number
_PAYLOAD_KEY = bytes([PAYLOAD_FIELD << 3 | 2])  # field number, wire type 2 (length-delimited)


# SegmentKind <-> KVSegmentKind on the wire (the proto's zero value is KV_SEGMENT_KIND_UNSPECIFIED).
_KIND_TO_WIRE = {SegmentKind.TARGET: kv_pb2.KV_SEGMENT_KIND_TARGET, SegmentKind.DRAFT: kv_pb2.KV_SEGMENT_KIND_DRAFT,
                 SegmentKind.STATE: kv_pb2.KV_SEGMENT_KIND_STATE}
_KIND_FROM_WIRE = {wire: kind for kind, wire in _KIND_TO_WIRE.items()}


def kind_to_wire(kind: SegmentKind) -> int:
    return _KIND_TO_WIRE[kind]


def kind_from_wire(value: int) -> SegmentKind | None:
    """None for KV_SEGMENT_KIND_UNSPECIFIED or an unknown value."""
    return _KIND_FROM_WIRE.get(value)


class WireChunk(NamedTuple):
    """header: a PushRequest without payload; payload: the bytes, as one buffer or a list of pieces."""

    header: kv_pb2.PushRequest
    payload: object

    @property
    def pieces(self) -> list:
        return self.payload if isinstance(self.payload, list) else [self.payload]


def encode_chunk(chunk: WireChunk) -> bytes:
    """The payload field first, then the header fields (protobuf allows any field order)."""
    pieces = chunk.pieces
    size = sum(len(piece) for piece in pieces)
    return b"".join([_PAYLOAD_KEY, encode_varint(size), *pieces, chunk.header.SerializeToString()])


def decode_chunk(raw: bytes) -> WireChunk:
    """Splits a serialized PushRequest into its header (parsed) and its payload (a view of raw, no copy)."""
    view = memoryview(raw)
    if raw[:1] == _PAYLOAD_KEY:  # our own encoding: payload first, no other payload field after it
        size, start = read_varint(view, 1)
        header = kv_pb2.PushRequest.FromString(view[start + size :].tobytes())
        if not header.payload:  # (a second payload field would win: then take the general path)
            return WireChunk(header, view[start : start + size])
    header_parts, payload = [], view[:0]
    try:
        for field in iter_fields(view):
            if field.number == PAYLOAD_FIELD and field.wire_type == 2:
                payload = view[field.value_start : field.end]
            else:
                header_parts.append(view[field.start : field.end])
    except ValueError as error:
        raise ValueError(f"malformed PushRequest: {error}") from error
    return WireChunk(kv_pb2.PushRequest.FromString(b"".join(header_parts)), payload)


def chunk_plan(page_bytes: int, num_pages: int, max_chunk: int) -> Iterator[tuple[int, int, int, int]]:
    """(first page index, page count, byte offset in the first page, nbytes) covering num_pages pages.

    Chunks hold whole pages when a page fits in max_chunk; larger pages are split across chunks.
    """
    step = (max_chunk // page_bytes) * page_bytes if page_bytes <= max_chunk else max_chunk
    total = num_pages * page_bytes
    for start in range(0, total, step):
        end = min(start + step, total)
        first, last = start // page_bytes, (end - 1) // page_bytes
        yield first, last - first + 1, start % page_bytes, end - start


def gather(view: memoryview, page_offsets: Sequence[int], first: int, count: int, offset: int, nbytes: int,
           page_bytes: int) -> list[memoryview]:
    """Views of the payload: nbytes from page `first` (at offset) on, pages found at page_offsets in view;
    pages that are contiguous in view come back as one piece."""
    pieces: list[list[int]] = []
    remaining, position = nbytes, offset
    for index in range(first, first + count):
        take = min(page_bytes - position, remaining)
        start = page_offsets[index] + position
        if pieces and pieces[-1][1] == start:
            pieces[-1][1] = start + take
        else:
            pieces.append([start, start + take])
        remaining -= take
        position = 0
    return [view[start:end] for start, end in pieces]


class ChunkEncoder:
    """Numbers and checksums the chunks of one Push stream (one request, one rank)."""

    def __init__(self, destination: Destination, rank: int, layout: KVLayout, max_chunk: int = MAX_CHUNK_BYTES,
                 algorithm: Algorithm = DEFAULT_ALGORITHM) -> None:
        if not 0 < max_chunk <= MAX_CHUNK_BYTES:
            raise ValueError(f"max_chunk must be in 1..{MAX_CHUNK_BYTES}")
        destination.target(rank)
        self.destination = destination
        self.rank = rank
        self.layout = layout
        self.max_chunk = max_chunk
        self.algorithm = Algorithm(algorithm)
        self.sequence = 0
        self.bytes = 0

    def encode(self, kind: SegmentKind, layer: int, first_index: int, view: memoryview,
               page_offsets: Sequence[int]) -> Iterator[WireChunk]:
        """Chunks for destination pages first_index.. whose bytes sit at page_offsets[i] in view. The
        payload pieces are views of `view`: it must not change until the chunks are sent."""
        page_bytes = self.layout.page_bytes(kind)
        dest = self.destination
        for first, count, offset, nbytes in chunk_plan(page_bytes, len(page_offsets), self.max_chunk):
            dest.check_lease()
            pieces = gather(view, page_offsets, first, count, offset, nbytes, page_bytes)
            if len(pieces) == 1:
                checksum = digest(pieces[0], self.algorithm)
            else:
                hasher = Hasher(self.algorithm)
                for piece in pieces:
                    hasher.update(piece)
                checksum = hasher.intdigest()
            header = kv_pb2.PushRequest(
                rank=self.rank, sequence=self.sequence, kind=kind_to_wire(kind), layer=layer,
                page_ids=dest.units(kind)[first_index + first : first_index + first + count],
                first_page_offset=offset, checksum=checksum, checksum_algorithm=int(self.algorithm),
            )
            if self.sequence == 0:
                header.request_id, header.lease_id, header.layout_hash = dest.request_id, dest.lease_id, dest.layout_hash
            self.sequence += 1
            self.bytes += nbytes
            yield WireChunk(header, pieces)
