"""Protobuf wire format by hand, for the two places that must see the bytes protobuf parsing hides: the
gateway's oneof check (which fields a message sets) and the KV chunk codec (payload bytes without a copy)."""
from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

_FIXED_WIDTH = {1: 8, 5: 4}  # wire type -> bytes (fixed64, fixed32)


def encode_varint(value: int) -> bytes:
    """Base-128 varint of a non-negative integer."""
    if value < 0:
        raise ValueError(f"varint of a negative number {value}")
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def read_varint(data: bytes | memoryview, position: int) -> tuple[int, int]:
    """(value, position after it) of the varint at position; ValueError if truncated or over 64 bits."""
    result = shift = 0
    while True:
        if position >= len(data):
            raise ValueError("truncated varint")
        byte = data[position]
        position += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, position
        shift += 7
        if shift > 63:
            raise ValueError("malformed varint (over 64 bits)")


class WireField(NamedTuple):
    number: int
    wire_type: int
    start: int        # where the field's key begins
    value_start: int  # where its value begins (after the length, for wire type 2)
    end: int          # one past its last byte


def iter_fields(data: bytes | memoryview) -> Iterator[WireField]:
    """The top-level fields of a serialized message, in wire order; ValueError on unsupported wire types
    (groups) or a field running past the end."""
    position = 0
    while position < len(data):
        start = position
        key, position = read_varint(data, position)
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            _, end = read_varint(data, position)
        elif wire_type == 2:
            length, position = read_varint(data, position)
            end = position + length
        elif wire_type in _FIXED_WIDTH:
            end = position + _FIXED_WIDTH[wire_type]
        else:
            raise ValueError(f"unsupported wire type {wire_type}")
        if end > len(data):
            raise ValueError(f"field {number} runs past the end of the message")
        yield WireField(number, wire_type, start, position, end)
        position = end
