"""rpc.wire: varints round-trip and agree with protobuf; iter_fields finds every top-level field with its exact
byte span and refuses truncated or unsupported input."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rpc.internal.v1 import kv_pb2
from rpc.wire import encode_varint, iter_fields, read_varint


@given(st.integers(min_value=0, max_value=2**64 - 1))
def test_varint_round_trip(value: int) -> None:
    """read_varint(encode_varint(v)) == v and consumes exactly the encoding."""
    raw = b"\x00" + encode_varint(value) + b"\xff"
    assert read_varint(raw, 1) == (value, len(raw) - 1)


def test_varint_refuses_bad_input() -> None:
    """Negative values, truncation and an 11-byte varint are errors, not garbage."""
    with pytest.raises(ValueError):
        encode_varint(-1)
    with pytest.raises(ValueError, match="truncated"):
        read_varint(b"\x80\x80", 0)
    with pytest.raises(ValueError, match="64 bits"):
        read_varint(b"\xff" * 11, 0)


def test_fields_match_protobuf_serialisation() -> None:
    """Each field's span re-parses to just that field; the spans tile the message."""
    message = kv_pb2.PushRequest(request_id="r", sequence=300, page_ids=[1, 2, 3], payload=b"xyz", checksum=7)
    raw = message.SerializeToString()
    fields = list(iter_fields(raw))
    assert [field.start for field in fields[1:]] == [field.end for field in fields[:-1]] and fields[-1].end == len(raw)
    payload = next(field for field in fields if field.number == kv_pb2.PushRequest.PAYLOAD_FIELD_NUMBER)
    assert raw[payload.value_start : payload.end] == b"xyz"
    for field in fields:
        alone = kv_pb2.PushRequest.FromString(raw[field.start : field.end])
        assert alone.ListFields()[0][0].number == field.number


def test_fields_refuse_truncation_and_groups() -> None:
    """A length running past the end, or a group wire type, raise ValueError."""
    with pytest.raises(ValueError, match="past the end"):
        list(iter_fields(b"\x0a\x05ab"))
    with pytest.raises(ValueError, match="wire type 3"):
        list(iter_fields(b"\x0b"))
