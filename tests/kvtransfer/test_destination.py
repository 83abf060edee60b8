"""Destination <-> KVDestination message, and the checks a destination makes before any write."""
from __future__ import annotations

import dataclasses
import time

import pytest

from kvtransfer.destination import Destination, TransportKind
from kvtransfer.errors import BadChunk, LayoutMismatch, LeaseExpired
from rpc.internal.v1 import kv_pb2

from .conftest import DEEPSEEK_V3, SMALL_WITH_DRAFT


def make(**changes) -> Destination:
    fields = dict(
        transport=TransportKind.MOONCAKE, layout_hash=SMALL_WITH_DRAFT.hash, request_id="req-1", lease_id="lease-1",
        page_ids=(7, 3, 9), targets=("a:1", "b:2"), lease_deadline_unix_ms=int(time.time() * 1000) + 60_000,
        num_tokens=40, pool_num_pages=12, completion_slot=5, completion_sequence=17,
        data_addresses=(1 << 40, 1 << 41), record_addresses=(123, 456),
    )
    fields.update(changes)
    return Destination(**fields)


def test_proto_round_trip_keeps_every_field():
    """from_proto(to_proto(d)) == d, also through serialized bytes."""
    destination = make()
    wire = destination.to_proto().SerializeToString()
    assert Destination.from_proto(kv_pb2.KVDestination.FromString(wire)) == destination
    assert kv_pb2.KVDestination.FromString(wire).transport == kv_pb2.TRANSPORT_MOONCAKE


def test_transport_values_match_the_proto_enum():
    """TransportKind and the Transport enum of protos/pdserve/internal/v1/kv.proto agree value for value."""
    for kind in TransportKind:
        assert kv_pb2.Transport.Value(f"TRANSPORT_{kind.name}") == kind.value


def test_invalid_destinations_are_rejected():
    """Duplicate pages, no targets, pages outside the pool, or an unknown transport value raise ValueError."""
    with pytest.raises(ValueError):
        make(page_ids=(1, 1))
    with pytest.raises(ValueError):
        make(targets=())
    with pytest.raises(ValueError):
        make(page_ids=(12,))
    message = make().to_proto()
    message.transport = kv_pb2.TRANSPORT_UNSPECIFIED
    with pytest.raises(ValueError):
        Destination.from_proto(message)


def test_checks_before_writing():
    """Layout mismatch, a wrong page count for num_tokens and an expired lease are each refused."""
    destination = make(transport=TransportKind.SHM, data_addresses=(), record_addresses=())
    destination.check_against(SMALL_WITH_DRAFT, "test")  # 40 tokens / 16 per page -> 3 pages
    with pytest.raises(LayoutMismatch):
        destination.check_against(DEEPSEEK_V3, "test")
    with pytest.raises(BadChunk, match="need 2 pages"):
        dataclasses.replace(destination, num_tokens=32).check_against(SMALL_WITH_DRAFT, "test")
    with pytest.raises(LeaseExpired):
        dataclasses.replace(destination, lease_deadline_unix_ms=1).check_lease()


def test_narrowed_keeps_the_lease_binding():
    """A standing lease narrowed to a shorter prompt names the first ceil(n / page_size) pages and n tokens,
    keeps the binding of the whole lease (the completion slot's key), survives the proto round trip, and a
    destination whose pages are not a prefix of its lease's is refused."""
    whole = make(page_ids=(7, 3, 9, 1), num_tokens=64)
    narrow = whole.narrowed(20, 16)
    assert narrow.page_ids == (7, 3) and narrow.num_tokens == 20
    assert narrow.lease_page_ids == (7, 3, 9, 1) and narrow.lease_num_tokens == 64
    assert narrow.binding == whole.binding
    assert Destination.from_proto(narrow.to_proto()) == narrow
    assert narrow.narrowed(5, 16).binding == whole.binding  # narrowing again stays bound to the lease
    assert whole.narrowed(64, 16).binding == whole.binding
    for bad in (0, 65):
        with pytest.raises(ValueError):
            whole.narrowed(bad, 16)
    with pytest.raises(ValueError, match="prefix"):
        dataclasses.replace(narrow, page_ids=(3, 7))
    with pytest.raises(ValueError, match="prefix"):
        dataclasses.replace(narrow, num_tokens=65)
    with pytest.raises(ValueError, match="together"):
        dataclasses.replace(narrow, lease_num_tokens=0)
    assert dataclasses.replace(whole, page_ids=(7, 3)).binding != whole.binding  # an unnarrowed subset does not bind


def test_a_cached_binding_never_leaks_into_a_changed_copy():
    """binding is built once per Destination: a copy with other pages, tokens or lease (replace, narrowed)
    has its own binding even after the original's was read, and equality still compares fields only."""
    original = make(transport=TransportKind.SHM, data_addresses=(), record_addresses=())
    before = original.binding
    moved = dataclasses.replace(original, page_ids=(1, 2, 3))
    assert moved.binding != before and "1,2,3" in moved.binding
    assert dataclasses.replace(original, lease_id="other").binding != before
    assert original.narrowed(17, 16).binding == before  # narrowing keeps the lease it is bound to
    assert make(transport=TransportKind.SHM, data_addresses=(), record_addresses=(),
                lease_deadline_unix_ms=original.lease_deadline_unix_ms) == original
