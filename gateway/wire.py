"""Raw-bytes checks protobuf parsing would hide: which top-level fields a message sets on the wire.

A oneof keeps only the last member it parses, so a GenerateRequest that sets both text and token_ids
looks valid once parsed; the gateway rejects it by looking at the bytes first."""
from __future__ import annotations

from typing import NamedTuple

from rpc.v1 import gateway_pb2
from rpc.wire import iter_fields

_INPUT_FIELDS = frozenset({
    gateway_pb2.GenerateRequest.TEXT_FIELD_NUMBER, gateway_pb2.GenerateRequest.TOKEN_IDS_FIELD_NUMBER,
})


def top_level_fields(data: bytes) -> set[int]:
    """Field numbers present at the top level of a serialized message."""
    return {field.number for field in iter_fields(data)}


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
