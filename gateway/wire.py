"""Raw-bytes checks protobuf parsing would hide: which top-level fields a message sets on the wire.

A oneof keeps only the last member it parses, so a GenerateRequest that sets both text and token_ids
looks valid once parsed; the gateway rejects it by looking at the bytes first."""
from __future__ import annotations

from typing import NamedTuple

from rpc.v1 import gateway_pb2

_INPUT_FIELDS = frozenset({
    gateway_pb2.GenerateRequest.TEXT_FIELD_NUMBER, gateway_pb2.GenerateRequest.TOKEN_IDS_FIELD_NUMBER,
})


def _varint(data: bytes, position: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if position >= len(data):
            raise ValueError("truncated varint")
        byte = data[position]
        position += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, position
        shift += 7


def top_level_fields(data: bytes) -> set[int]:
    """Field numbers present at the top level of a serialized message."""
    fields: set[int] = set()
    position = 0
    while position < len(data):
        key, position = _varint(data, position)
        number, wire_type = key >> 3, key & 7
        fields.add(number)
        if wire_type == 0:
            _, position = _varint(data, position)
        elif wire_type == 1:
            position += 8
        elif wire_type == 2:
            length, position = _varint(data, position)
            position += length
        elif wire_type == 5:
            position += 4
        else:
            raise ValueError(f"unsupported wire type {wire_type}")
    return fields


class WireGenerateRequest(NamedTuple):
    message: gateway_pb2.GenerateRequest
    both_inputs: bool


def parse_generate_request_bytes(data: bytes) -> WireGenerateRequest:
    """The request deserializer the gateway registers for Generate."""
    message = gateway_pb2.GenerateRequest.FromString(data)
    try:
        both = _INPUT_FIELDS <= top_level_fields(data)
    except ValueError:
        both = False  # FromString accepted it; leave judgement to validation
    return WireGenerateRequest(message, both)
