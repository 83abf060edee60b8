"""KVTransferService.Push refuses bad streams with the right status before (or instead of) writing, fails only that
request, and hands its pages back through on_failed; the aio servicer behaves the same."""
from __future__ import annotations

import dataclasses
import time

import grpc
import pytest
import torch

from engine.cache.kv_cache import PageAllocator
from kvtransfer.chunks import ChunkEncoder, WireChunk
from kvtransfer.destination import Destination
from kvtransfer.errors import (
    BadChunk, ChecksumMismatch, KVTransferError, LayoutMismatch, LeaseExpired, TransferAborted, UnknownTransfer,
)
from kvtransfer.grpc_transport import GrpcWriter
from kvtransfer.layout import SegmentKind
from kvtransfer.leases import LeaseTable
from kvtransfer.page_spans import cache_view, segment_offset
from kvtransfer.shm_pool import SharedPagePool
from rpc.internal.v1 import kv_pb2, kv_pb2_grpc

from .conftest import SMALL_WITH_DRAFT, random_cache

LAYOUT = SMALL_WITH_DRAFT


def encode_all(destination, cache, source_pages, rank=0, max_chunk=4096, layout=LAYOUT) -> list[WireChunk]:
    encoder = ChunkEncoder(destination, rank, layout, max_chunk)
    _, num_pages, view = cache_view(cache)
    chunks = []
    for kind, layer in layout.segments():
        base, page_bytes = segment_offset(layout, num_pages, kind, layer), layout.page_bytes(kind)
        chunks += encoder.encode(kind, layer, 0, view, [base + page * page_bytes for page in source_pages])
    return chunks


@pytest.fixture
def decode(push_server):
    """A two-rank decode: shm pools, a PushReceiver served on port 0, an allocator freed via on_failed."""
    pools = [SharedPagePool.create(LAYOUT, 12, rank) for rank in range(2)]
    allocator, leases, failed, held = PageAllocator(12), LeaseTable(), [], {}

    def on_failed(request_id: str) -> None:
        failed.append(request_id)
        allocator.free(held.pop(request_id))

    receiver = push_server([pool.cache for pool in pools], on_failed=on_failed)

    def reserve(request_id: str, num_tokens: int, ttl_s: float = 60):
        pages = allocator.allocate(LAYOUT.pages_for_tokens(num_tokens))
        held[request_id] = pages
        return receiver.expect(leases.grant(request_id, pages, ttl_s), num_tokens)

    writer = GrpcWriter(LAYOUT)
    yield pools, receiver, allocator, reserve, failed, writer
    writer.close()
    for pool in pools:
        pool.close()
        pool.unlink()


def wait_for(predicate, timeout_s: float = 60.0) -> bool:
    """Polls predicate every millisecond; False (the caller asserts) if it never held within timeout_s."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def push_raw(writer: GrpcWriter, destination, chunks, rank=0):
    return writer.stub(destination.target(rank)).Push(iter(chunks), timeout=10)


def test_corrupted_chunk_is_data_loss_and_fails_only_that_request(decode):
    """One flipped payload byte on rank 0: DATA_LOSS, on_failed frees the pages, rank 1's stream already in
    flight is ABORTED, a new stream for it is NOT_FOUND, and a request pushed afterwards is admitted."""
    pools, receiver, allocator, reserve, failed, writer = decode
    source = random_cache(LAYOUT, 4, seed=5)
    bad = reserve("bad", 40)
    rank1 = writer.open(bad, rank=1)
    rank1.write_layer(0, source.layer(0)[:3])
    state = receiver._requests["bad"]
    assert wait_for(lambda: 1 in state.open_ranks)
    chunks = encode_all(bad, source, [0, 1, 2])
    payload = bytearray(b"".join(chunks[3].pieces))
    payload[100] ^= 0x10
    chunks[3] = WireChunk(chunks[3].header, bytes(payload))
    with pytest.raises(grpc.RpcError) as caught:
        push_raw(writer, bad, chunks)
    assert caught.value.code() == grpc.StatusCode.DATA_LOSS and "checksum" in caught.value.details()
    assert failed == ["bad"] and allocator.num_free == 12
    with pytest.raises(TransferAborted):
        for layer in range(1, LAYOUT.num_layers):
            rank1.write_layer(layer, source.layer(layer)[:3])
        rank1.finish()
    with pytest.raises(UnknownTransfer):
        writer.push(source, [0, 1, 2], bad, rank=1)
    with pytest.raises(ChecksumMismatch):
        receiver.admit("bad")
    good = reserve("good", 40)
    for rank in range(2):
        writer.push(source, [0, 1, 2], good, rank)
    assert receiver.admit("good", timeout_s=5).bytes == 2 * 3 * LAYOUT.bytes_per_page


def test_layout_mismatch_is_refused_before_any_byte_moves(decode):
    """A stream whose layout hash differs: FAILED_PRECONDITION and the pool is untouched; a writer with a
    different local layout refuses before connecting."""
    pools, receiver, allocator, reserve, failed, writer = decode
    for pool in pools:
        pool.tensor.view(torch.uint8).fill_(0x5A)
    destination = reserve("r", 40)
    other = dataclasses.replace(LAYOUT, page_size=8)
    forged = dataclasses.replace(destination, layout_hash=other.hash)
    chunks = encode_all(forged, random_cache(LAYOUT, 3, seed=6), [0, 1, 2])
    with pytest.raises(grpc.RpcError) as caught:
        push_raw(writer, destination, chunks)
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert other.hash in caught.value.details() and LAYOUT.hash in caught.value.details()
    assert all(pool.tensor.view(torch.uint8).eq(0x5A).all() for pool in pools)
    assert failed == ["r"]
    with pytest.raises(LayoutMismatch):
        GrpcWriter(other).open(destination)


@pytest.mark.parametrize("mutate,code", [
    (lambda chunks: [WireChunk(_with(chunks[0].header, lease_id="nope"), chunks[0].payload)] + chunks[1:],
     grpc.StatusCode.NOT_FOUND),
    (lambda chunks: [WireChunk(_with(chunks[0].header, request_id="other"), chunks[0].payload)] + chunks[1:],
     grpc.StatusCode.NOT_FOUND),
    (lambda chunks: chunks[:1] + [WireChunk(_with(chunks[1].header, page_ids=[11]), chunks[1].payload)],
     grpc.StatusCode.INVALID_ARGUMENT),
    (lambda chunks: chunks[:1] + chunks[2:], grpc.StatusCode.INVALID_ARGUMENT),  # a dropped chunk: sequence gap
    (lambda chunks: chunks[:-1], grpc.StatusCode.DATA_LOSS),  # the stream ends early: short write
    (lambda chunks: [WireChunk(_with(chunks[0].header, rank=5), chunks[0].payload)], grpc.StatusCode.INVALID_ARGUMENT),
    (lambda chunks: [], grpc.StatusCode.INVALID_ARGUMENT),
])
def test_bad_streams_get_their_status(decode, mutate, code):
    """Wrong lease or request: NOT_FOUND; a page outside the lease, a sequence gap, a bad rank or an empty
    stream: INVALID_ARGUMENT; a stream that stops short: DATA_LOSS."""
    pools, receiver, allocator, reserve, failed, writer = decode
    destination = reserve("r", 40)
    chunks = encode_all(destination, random_cache(LAYOUT, 3, seed=7), [0, 1, 2])
    with pytest.raises(grpc.RpcError) as caught:
        push_raw(writer, destination, mutate(chunks))
    assert caught.value.code() == code, caught.value.details()
    if code == grpc.StatusCode.NOT_FOUND:  # a stranger's stream cannot fail someone else's request
        assert failed == [] and "r" in receiver._requests
    elif mutate(chunks):
        assert failed == ["r"] and allocator.num_free == 12


def _with(header: kv_pb2.PushRequest, **fields) -> kv_pb2.PushRequest:
    copy = kv_pb2.PushRequest()
    copy.CopyFrom(header)
    for name, value in fields.items():
        if name == "page_ids":
            del copy.page_ids[:]
            copy.page_ids.extend(value)
        else:
            setattr(copy, name, value)
    return copy


def test_a_page_written_twice_is_refused(decode):
    """Repeating a chunk (same pages, next sequence number) is INVALID_ARGUMENT, not a silent overwrite."""
    pools, receiver, allocator, reserve, failed, writer = decode
    destination = reserve("r", 40)
    chunks = encode_all(destination, random_cache(LAYOUT, 3, seed=8), [0, 1, 2])
    repeated = WireChunk(_with(chunks[0].header, sequence=1, request_id="", lease_id="", layout_hash=""), chunks[0].payload)
    with pytest.raises(grpc.RpcError) as caught:
        push_raw(writer, destination, [chunks[0], repeated])
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "twice" in caught.value.details()


def test_half_a_page_written_twice_is_refused(decode):
    """Chunks of half a page: the first half sent twice in place of the second adds up to a page's byte
    count, yet is refused as written twice (byte ranges are tracked, not counts), and the request fails."""
    pools, receiver, allocator, reserve, failed, writer = decode
    destination = reserve("r", 40)
    half = LAYOUT.page_bytes(next(iter(LAYOUT.segments()))[0]) // 2
    chunks = encode_all(destination, random_cache(LAYOUT, 3, seed=8), [0, 1, 2], max_chunk=half)
    assert chunks[0].header.first_page_offset == 0 and chunks[1].header.first_page_offset == half
    again = WireChunk(_with(chunks[0].header, sequence=1, request_id="", lease_id="", layout_hash=""), chunks[0].payload)
    with pytest.raises(grpc.RpcError) as caught:
        push_raw(writer, destination, [chunks[0], again, *chunks[2:]])
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "written twice" in caught.value.details()
    assert wait_for(lambda: failed == ["r"]) and allocator.num_free == 12


def _unexpired_copy(destination):
    """The destination as a writer with a slow clock sees it: its lease still an hour away."""
    return dataclasses.replace(destination, lease_deadline_unix_ms=destination.lease_deadline_unix_ms + 3_600_000)


def test_lease_expired_on_decode_only_is_reported_as_lease_expiry(decode):
    """The writer thinks the lease is valid, decode's has passed: push() raises LeaseExpired (the status
    names the class), not the UnknownTransfer that shares its NOT_FOUND code."""
    pools, receiver, allocator, reserve, failed, writer = decode
    destination = reserve("r", 40, ttl_s=0.001)
    assert wait_for(lambda: time.time() * 1000 > destination.lease_deadline_unix_ms)
    with pytest.raises(LeaseExpired):
        writer.push(random_cache(LAYOUT, 3, seed=16), [0, 1, 2], _unexpired_copy(destination))
    assert wait_for(lambda: failed == ["r"]) and allocator.num_free == 12


def test_push_after_the_sweeper_dropped_an_expired_lease_reports_lease_expiry(decode):
    """Decode already dropped the request because its lease ran out (receiver.cancel, as the sweeper does):
    a late push still learns LeaseExpired; a push for a request cancelled before its deadline is
    UnknownTransfer."""
    pools, receiver, allocator, reserve, failed, writer = decode
    expired = reserve("late", 40, ttl_s=0.001)
    cancelled = reserve("gone", 40, ttl_s=60)
    assert wait_for(lambda: time.time() * 1000 > expired.lease_deadline_unix_ms)
    receiver.cancel("late")
    receiver.cancel("gone")
    source = random_cache(LAYOUT, 3, seed=17)
    with pytest.raises(LeaseExpired):
        writer.push(source, [0, 1, 2], _unexpired_copy(expired))
    with pytest.raises(UnknownTransfer):
        writer.push(source, [0, 1, 2], cancelled)


def test_expired_lease_stops_the_push(decode):
    """A lease that expires before the stream arrives: NOT_FOUND, request failed, pages back."""
    pools, receiver, allocator, reserve, failed, writer = decode
    destination = reserve("r", 40, ttl_s=0.001)
    chunks = encode_all(dataclasses.replace(destination, lease_deadline_unix_ms=destination.lease_deadline_unix_ms + 60_000),
                        random_cache(LAYOUT, 3, seed=9), [0, 1, 2])
    with pytest.raises(grpc.RpcError) as caught:
        push_raw(writer, destination, chunks)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND and "expired" in caught.value.details()
    assert failed == ["r"] and allocator.num_free == 12


def test_standard_protobuf_client_and_write_handle(decode):
    """Plain PushRequest messages from the generated stub are accepted; a write handle streams pages as they
    are written (pages split over 1000-byte chunks)."""
    pools, receiver, allocator, reserve, failed, writer = decode
    source = random_cache(LAYOUT, 3, seed=10)
    destination = reserve("r", 40)
    messages = []
    for chunk in encode_all(destination, source, [2, 0, 1]):
        message = kv_pb2.PushRequest()
        message.CopyFrom(chunk.header)
        message.payload = b"".join(chunk.pieces)
        messages.append(message)
    stub = kv_pb2_grpc.KVTransferServiceStub(grpc.insecure_channel(destination.targets[0]))
    result = stub.Push(iter(messages), timeout=10)
    assert result.ok and result.bytes == 3 * LAYOUT.bytes_per_page
    with GrpcWriter(LAYOUT, max_chunk=1000).open(destination, rank=1) as handle:
        for kind, layer in LAYOUT.segments():
            pages = source.layer(layer) if kind == SegmentKind.TARGET else source.draft_layer(layer)
            handle.write_pages(kind, layer, 0, pages[[2, 0]])
            handle.write_pages(kind, layer, 2, pages[1:2])
        assert handle.finish().bytes == 3 * LAYOUT.bytes_per_page
    receiver.admit("r", timeout_s=5)
    for pool in pools:
        assert torch.equal(pool.cache.kv[:, list(destination.page_ids)].view(torch.uint8),
                           source.kv[:, [2, 0, 1]].view(torch.uint8))


def test_handle_rejects_bad_data_before_sending(decode):
    """write_pages with the wrong shape raises BadChunk locally."""
    pools, receiver, allocator, reserve, failed, writer = decode
    with writer.open(reserve("r", 40)) as handle:
        with pytest.raises(BadChunk):
            handle.write_pages(SegmentKind.TARGET, 0, 0, torch.zeros(3, 16, 81, dtype=torch.bfloat16))
        handle.abort("test over")


def test_aborted_handle_fails_the_request_and_frees_pages(decode):
    """A writer that gives up mid-stream (an exception inside the handle's with-block) cancels the Push:
    decode fails the request, on_failed frees its pages, admit raises. (A stream cancelled before its
    first chunk arrived names no request: that lease is freed by expiry.)"""
    pools, receiver, allocator, reserve, failed, writer = decode
    destination = reserve("r", 40)
    source = random_cache(LAYOUT, 3, seed=14)
    state = receiver._requests["r"]
    with pytest.raises(RuntimeError, match="prefill crashed"):
        with writer.open(destination) as handle:
            handle.write_layer(0, source.layer(0)[:3])
            assert wait_for(lambda: 0 in state.open_ranks)  # decode knows the stream's request
            raise RuntimeError("prefill crashed")
    assert wait_for(lambda: failed == ["r"])
    assert allocator.num_free == 12
    with pytest.raises(KVTransferError):
        receiver.admit("r")


def test_lease_expiring_mid_push_is_reported_as_such(decode):
    """push() whose lease runs out between chunks raises LeaseExpired (not a bare stream error)."""
    pools, receiver, allocator, reserve, failed, writer = decode
    destination = reserve("r", 40, ttl_s=60)
    source = random_cache(LAYOUT, 3, seed=15)
    calls = {"count": 0}
    real_check = Destination.check_lease

    def expiring(self, at_ms=None):
        calls["count"] += 1
        if calls["count"] > 3:  # the first chunks go out, then the deadline passes
            raise LeaseExpired("lease expired (test)")
        return real_check(self, at_ms)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Destination, "check_lease", expiring)
        with pytest.raises(LeaseExpired):
            GrpcWriter(LAYOUT, max_chunk=4096).push(source, [0, 1, 2], destination)
    assert wait_for(lambda: failed == ["r"]) and allocator.num_free == 12


def test_push_receiver_admits_once_every_rank_pushed(decode):
    """admit_now of a gRPC push: None while a rank is missing; the result once both ranks' pushes finished."""
    pools, receiver, allocator, reserve, failed, writer = decode
    source = random_cache(LAYOUT, 2, seed=5)
    destination = reserve("p", 20)
    assert push_raw(writer, destination, encode_all(destination, source, [0, 1], rank=0), rank=0).ok
    assert receiver.admit_now("p", 0) is None
    assert push_raw(writer, destination, encode_all(destination, source, [0, 1], rank=1), rank=1).ok
    result = receiver.admit_now("p", 0)
    assert result is not None and result.bytes == 2 * 2 * LAYOUT.bytes_per_page
    assert failed == []
