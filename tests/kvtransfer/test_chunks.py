"""Chunk framing: the plan covers every byte once within the size limit, and the wire codec is ordinary
protobuf (decodes what the generated code encodes, and the reverse) with the payload kept out of it."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtransfer.chunks import (
    MAX_CHUNK_BYTES, WireChunk, chunk_plan, decode_chunk, encode_chunk, gather, kind_from_wire, kind_to_wire,
)
from kvtransfer.layout import SegmentKind
from rpc.internal.v1 import kv_pb2


@settings(max_examples=200, deadline=None)
@given(page_bytes=st.integers(1, 5000), num_pages=st.integers(1, 40), max_chunk=st.integers(1, 12000))
def test_plan_covers_every_byte_once(page_bytes, num_pages, max_chunk):
    """Chunks are contiguous, in order, at most max_chunk bytes, whole pages when a page fits, and the
    (page, offset) of each chunk start is right."""
    position = 0
    for first, count, offset, nbytes in chunk_plan(page_bytes, num_pages, max_chunk):
        assert first * page_bytes + offset == position
        assert 0 < nbytes <= max_chunk and 0 <= offset < page_bytes
        assert (first + count - 1) * page_bytes < position + nbytes <= (first + count) * page_bytes
        if page_bytes <= max_chunk:
            assert offset == 0 and nbytes % page_bytes == 0
        position += nbytes
    assert position == page_bytes * num_pages


def test_gather_joins_contiguous_pages():
    """Pages adjacent in the source come back as one view; others as separate pieces, in order."""
    view = memoryview(bytes(range(100)))
    pieces = gather(view, [0, 10, 50], first=0, count=3, offset=2, nbytes=25, page_bytes=10)
    assert [bytes(piece) for piece in pieces] == [bytes(range(2, 20)), bytes(range(50, 57))]


def test_codec_is_plain_protobuf_both_ways():
    """encode_chunk output parses with PushRequest.FromString; decode_chunk reads a SerializeToString'd message
    (payload in the middle of the fields, as any encoder may place it)."""
    header = kv_pb2.PushRequest(request_id="r", lease_id="l", layout_hash="h", rank=1, sequence=300, kind=1, layer=7,
                            page_ids=[5, 900, 70000], first_page_offset=12, checksum=2**63 + 5, checksum_algorithm=1)
    payload = bytes(range(256)) * 600
    wire = encode_chunk(WireChunk(header, [memoryview(payload)[:1000], memoryview(payload)[1000:]]))
    message = kv_pb2.PushRequest.FromString(wire)
    assert message.payload == payload and message.page_ids == [5, 900, 70000] and message.checksum == 2**63 + 5
    full = kv_pb2.PushRequest()
    full.CopyFrom(header)
    full.payload = payload
    decoded = decode_chunk(full.SerializeToString())
    assert bytes(decoded.payload) == payload
    assert decoded.header == header
    assert isinstance(decoded.payload, memoryview)


def test_max_chunk_is_under_grpc_message_limit():
    """A full chunk plus its header stays far below gRPC's 4 MiB default."""
    header = kv_pb2.PushRequest(request_id="x" * 200, lease_id="y" * 64, layout_hash="z" * 16,
                            page_ids=list(range(1 << 14)), checksum=1)
    assert len(encode_chunk(WireChunk(header, bytes(MAX_CHUNK_BYTES)))) < 2 * MAX_CHUNK_BYTES


def test_own_encoding_round_trips_and_last_payload_wins():
    """decode_chunk(encode_chunk(c)) gives c back; a message carrying a second payload field later decodes to
    that one, as protobuf's last-one-wins rule says."""
    header = kv_pb2.PushRequest(request_id="r", sequence=9, page_ids=[1, 2], checksum=77)
    payload = bytes(range(200)) * 10
    decoded = decode_chunk(encode_chunk(WireChunk(header, [payload[:7], payload[7:]])))
    assert decoded.header == header and bytes(decoded.payload) == payload
    second = kv_pb2.PushRequest(payload=b"later").SerializeToString()
    decoded = decode_chunk(encode_chunk(WireChunk(header, payload)) + second)
    assert bytes(decoded.payload) == b"later"
    assert kv_pb2.PushRequest.FromString(encode_chunk(WireChunk(header, payload)) + second).payload == b"later"


def test_segment_kind_wire_values():
    """SegmentKind maps to the proto's KV_SEGMENT_KIND_* values both ways; the zero value
    KV_SEGMENT_KIND_UNSPECIFIED (and unknown values) map to None, which the receiver refuses."""
    for kind in SegmentKind:
        assert kind_from_wire(kind_to_wire(kind)) is kind
    assert kind_to_wire(SegmentKind.TARGET) == kv_pb2.KV_SEGMENT_KIND_TARGET
    assert kind_from_wire(kv_pb2.KV_SEGMENT_KIND_UNSPECIFIED) is None and kind_from_wire(99) is None
