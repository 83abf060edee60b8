"""The linear-attention (KDA) state slot travels with the latent pages (issue 14 item 3): the layout hash
covers the state's shapes and dtypes, shm writes land in the reserved slot and are checksummed with the
pages, gRPC carries the slot chunked and checksummed with byte-range tracking, and a state-layout mismatch
is refused (FAILED_PRECONDITION) before any byte moves."""
from __future__ import annotations

import dataclasses

import grpc
import pytest
import torch

from engine.cache.kv_cache import PagedLatentCache
from kvtransfer.chunks import ChunkEncoder, WireChunk
from kvtransfer.destination import Destination, TransportKind
from kvtransfer.errors import BadChunk, ChecksumMismatch, IncompleteTransfer, LayoutMismatch
from kvtransfer.grpc_transport import GrpcWriter
from kvtransfer.layout import KVLayout, SegmentKind, StateLayout
from kvtransfer.leases import LeaseTable
from kvtransfer.page_spans import cache_view, segment_offset
from kvtransfer.shm_pool import SharedPagePool
from kvtransfer.shm_receiver import ShmReceiver
from kvtransfer.shm_transport import ShmWriter
from rpc.internal.v1 import kv_pb2, kv_pb2_grpc

from .conftest import SMALL_WITH_DRAFT

# The tiny K3 of the tests at TP=2: 6 KDA layers, 12 heads of 8, conv window 3 (fp32 conv and state).
STATE = StateLayout(state_layers=6, conv_width=3, conv_channels=3 * 12 * 8, state_heads=12, head_k_dim=8, head_v_dim=8,
                    conv_dtype="float32", ssm_dtype="float32")
LAYOUT = dataclasses.replace(SMALL_WITH_DRAFT, state=STATE)
NUM_PAGES, NUM_SLOTS = 8, 3


def test_hash_covers_state_shapes_and_dtypes_and_keeps_pure_mla_hashes():
    """Changing any state field changes the hash; a layout without state hashes as it always did."""
    hashes = {LAYOUT.hash}
    for name, value in [("state_layers", 7), ("conv_width", 2), ("conv_channels", 3 * 6 * 8), ("state_heads", 6),
                        ("head_k_dim", 16), ("head_v_dim", 16), ("conv_dtype", "bfloat16"), ("ssm_dtype", "bfloat16")]:
        hashes.add(dataclasses.replace(LAYOUT, state=dataclasses.replace(STATE, **{name: value})).hash)
    assert len(hashes) == 9
    assert SMALL_WITH_DRAFT.hash != LAYOUT.hash
    assert "state" not in SMALL_WITH_DRAFT.canonical  # unchanged text => unchanged hash for DeepSeek-V3
    assert KVLayout.from_proto(LAYOUT.to_proto()) == LAYOUT
    partial = SMALL_WITH_DRAFT.to_proto()
    partial.conv_width = 3  # a state field without state_layers
    with pytest.raises(ValueError, match="state"):
        KVLayout.from_proto(partial)
    with pytest.raises(ValueError, match="StateLayout.conv_width"):
        dataclasses.replace(STATE, conv_width=0)


def test_state_shape_round_trips_through_the_engine_cache_shape():
    """KVLayout <-> CacheShape keeps the state geometry, and the state slots sit after the pages."""
    shape = LAYOUT.to_cache_shape(NUM_PAGES, NUM_SLOTS)
    assert shape.state is not None and shape.state.num_slots == NUM_SLOTS
    assert KVLayout.from_cache_shape(shape) == LAYOUT
    assert shape.state_offset == LAYOUT.state_offset(NUM_PAGES) >= NUM_PAGES * LAYOUT.bytes_per_page
    assert shape.buffer_bytes == LAYOUT.pool_bytes(NUM_PAGES, NUM_SLOTS)


@pytest.fixture
def shm_decode():
    pools = [SharedPagePool.create(LAYOUT, NUM_PAGES, rank, num_state_slots=NUM_SLOTS) for rank in range(2)]
    yield pools, ShmReceiver(pools), LeaseTable()
    for pool in pools:
        pool.close()
        pool.unlink()


def test_shm_writes_the_state_into_the_reserved_slot_and_checksums_it(shm_decode):
    """Prefill writes pages + state slot in place on each rank; decode admits them and the slot holds
    exactly what prefill wrote; a state byte changed after the record fails the checksum."""
    pools, receiver, leases = shm_decode
    writer = ShmWriter(LAYOUT)
    try:
        for attempt, corrupt in enumerate((False, True)):
            request = f"r{attempt}"
            destination = receiver.expect(leases.grant(request, (1, 2), 60, state_slot=2), 20)
            assert destination.state_slot == 2 and destination.units(SegmentKind.STATE) == (2,)
            rows = []
            for rank, pool in enumerate(pools):
                handle = writer.open(destination, rank)
                for kind, layer in LAYOUT.segments():
                    if kind == SegmentKind.STATE:
                        row = torch.randint(0, 256, (1, LAYOUT.state_bytes), dtype=torch.uint8,
                                            generator=torch.Generator().manual_seed(10 * attempt + rank))
                        rows.append(row)
                        handle.write_pages(kind, 0, 0, row)
                    else:
                        data = torch.randn(2, LAYOUT.page_size, LAYOUT.row_dim(kind)).to(LAYOUT.torch_dtype)
                        handle.write_pages(kind, layer, 0, data)
                result = handle.finish()
                assert result.bytes == 2 * LAYOUT.bytes_per_page + LAYOUT.state_bytes
            if corrupt:
                pools[1].cache.state.raw[2, 5] ^= 0xFF
                with pytest.raises(ChecksumMismatch):
                    receiver.admit(request, timeout_s=5)
            else:
                assert receiver.admit(request, timeout_s=5).bytes == 2 * (2 * LAYOUT.bytes_per_page + LAYOUT.state_bytes)
                for rank, pool in enumerate(pools):
                    assert torch.equal(pool.cache.state.raw[2:3], rows[rank])
    finally:
        writer.close()


def test_shm_finish_refuses_a_missing_state_slot(shm_decode):
    """Pages without the state slot are an incomplete transfer (decode sees the writer's FAILED record)."""
    pools, receiver, leases = shm_decode
    destination = receiver.expect(leases.grant("r", (0,), 60, state_slot=0), 5)
    writer = ShmWriter(LAYOUT)
    try:
        handle = writer.open(destination, 0)
        for kind, layer in LAYOUT.segments()[:-1]:
            handle.write_pages(kind, layer, 0, torch.zeros(1, LAYOUT.page_size, LAYOUT.row_dim(kind), dtype=LAYOUT.torch_dtype))
        with pytest.raises(IncompleteTransfer, match="state"):
            handle.finish()
    finally:
        writer.close()


def test_a_state_layout_needs_a_state_slot_and_the_slot_must_exist(shm_decode):
    """expect() refuses a lease without a slot; a destination naming a slot outside the pool is refused."""
    pools, receiver, leases = shm_decode
    with pytest.raises(ValueError, match="state slot"):
        receiver.expect(leases.grant("a", (0,), 60), 5)
    destination = receiver.expect(leases.grant("b", (0,), 60, state_slot=1), 5)
    writer = ShmWriter(LAYOUT)
    try:
        with pytest.raises(BadChunk, match="state slot"):
            writer.open(dataclasses.replace(destination, state_slot=NUM_SLOTS), 0)
    finally:
        writer.close()


@pytest.fixture
def grpc_decode(push_server):
    pools = [SharedPagePool.create(LAYOUT, NUM_PAGES, rank, num_state_slots=NUM_SLOTS) for rank in range(2)]
    receiver = push_server([pool.cache for pool in pools])
    yield pools, receiver, LeaseTable()
    for pool in pools:
        pool.close()
        pool.unlink()


def _prefill_cache(seed: int):
    """Prefill's own cache (pages + 2 state slots) filled with random bits."""
    local = PagedLatentCache(LAYOUT.to_cache_shape(6, 2))
    raw = local.buffer.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))
    return local


def test_grpc_push_carries_the_state_slot_chunked(grpc_decode):
    """GrpcWriter.push streams pages and the state slot (several chunks: max_chunk below the slot size);
    decode's slot then equals prefill's source slot byte for byte, on every rank."""
    pools, receiver, leases = grpc_decode
    source = _prefill_cache(3)
    destination = receiver.expect(leases.grant("g", (4, 5), 60, state_slot=1), 30)
    writer = GrpcWriter(LAYOUT, max_chunk=4096)
    try:
        assert LAYOUT.state_bytes > 4096
        for rank in range(2):
            writer.push(source, [3, 0], destination, rank, source_state_slot=0)
        assert receiver.admit("g", timeout_s=10).bytes == 2 * (2 * LAYOUT.bytes_per_page + LAYOUT.state_bytes)
    finally:
        writer.close()
    for pool in pools:
        assert torch.equal(pool.cache.state.raw[1], source.state.raw[0])
        pages = pool.cache.kv.view(torch.uint8)
        assert torch.equal(pages[:, 4], source.kv.view(torch.uint8)[:, 3])
        assert torch.equal(pages[:, 5], source.kv.view(torch.uint8)[:, 0])


def _state_chunks(destination: Destination, source, layout=LAYOUT, max_chunk=4096):
    encoder = ChunkEncoder(destination, 0, layout, max_chunk)
    _, num_pages, view = cache_view(source)
    chunks = []
    for kind, layer in layout.segments():
        base, unit = segment_offset(layout, num_pages, kind, layer), layout.page_bytes(kind)
        ids = [0] if kind == SegmentKind.STATE else list(range(len(destination.page_ids)))
        chunks += encoder.encode(kind, layer, 0, view, [base + i * unit for i in ids])
    return chunks


def test_grpc_refuses_a_state_byte_written_twice(grpc_decode):
    """A stream that repeats a state chunk (same bytes, renumbered) is refused: a byte is written twice."""
    pools, receiver, leases = grpc_decode
    source = _prefill_cache(4)
    destination = receiver.expect(leases.grant("twice", (2,), 60, state_slot=0), 3)
    chunks = _state_chunks(destination, source)
    state = [c for c in chunks if c.header.kind == kv_pb2.KV_SEGMENT_KIND_STATE]
    assert len(state) >= 2
    repeat = kv_pb2.PushRequest()
    repeat.CopyFrom(state[0].header)
    repeat.sequence = len(chunks)
    stream = [WireChunk(c.header, b"".join(bytes(p) for p in c.pieces)) for c in chunks + [WireChunk(repeat, state[0].payload)]]
    session = receiver.open_stream()
    with pytest.raises(BadChunk, match="written twice"):
        for chunk in stream:
            session.apply(chunk)


def test_grpc_state_layout_mismatch_is_failed_precondition_before_any_byte(grpc_decode):
    """A prefill whose state shapes differ (here: TP=1 heads against a TP=2 decode) pushes under another
    layout hash: Push answers FAILED_PRECONDITION (LayoutMismatch) and no byte of the pool changed."""
    pools, receiver, leases = grpc_decode
    other = dataclasses.replace(LAYOUT, state=dataclasses.replace(STATE, conv_channels=3 * 24 * 8, state_heads=24))
    destination = receiver.expect(leases.grant("mm", (1,), 60, state_slot=2), 4)
    before = [bytes(cache_view(pool.cache)[2]) for pool in pools]
    mine = PagedLatentCache(other.to_cache_shape(4, 1))
    wrong = dataclasses.replace(destination, layout_hash=other.hash)
    chunks = _state_chunks(wrong, mine, layout=other)
    channel = grpc.insecure_channel(receiver.addresses[0])
    try:
        stub = kv_pb2_grpc.KVTransferServiceStub(channel)
        requests = [kv_pb2.PushRequest(**{f.name: getattr(c.header, f.name) for f in c.header.DESCRIPTOR.fields
                                          if f.name != "payload"}, payload=b"".join(bytes(p) for p in c.pieces))
                    for c in chunks[:3]]
        with pytest.raises(grpc.RpcError) as error:
            stub.Push(iter(requests), timeout=10)
        assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        channel.close()
    assert [bytes(cache_view(pool.cache)[2]) for pool in pools] == before
    with pytest.raises(LayoutMismatch):
        GrpcWriter(other).open(destination, 0)


def test_shm_state_layout_mismatch_is_refused_before_any_byte(shm_decode):
    """A prefill with other state shapes cannot attach decode's pool nor open its destination."""
    pools, receiver, leases = shm_decode
    other = dataclasses.replace(LAYOUT, state=dataclasses.replace(STATE, ssm_dtype="bfloat16"))
    destination = receiver.expect(leases.grant("mm", (1,), 60, state_slot=2), 4)
    before = [bytes(cache_view(pool.cache)[2]) for pool in pools]
    with pytest.raises(LayoutMismatch):
        SharedPagePool.attach(pools[0].name, other)
    writer = ShmWriter(other)
    try:
        with pytest.raises(LayoutMismatch):
            writer.open(destination, 0)
    finally:
        writer.close()
    assert [bytes(cache_view(pool.cache)[2]) for pool in pools] == before
    assert destination.transport == TransportKind.SHM
