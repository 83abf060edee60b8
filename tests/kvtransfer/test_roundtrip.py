"""Round trip over shm and grpc: random layouts and page sets, TP 1 and 2; the decode pool ends up holding
exactly prefill's bytes in the reserved pages (and nothing else changes)."""
from __future__ import annotations

import random

import pytest
import torch

from engine.cache.kv_cache import PagedLatentCache
from kvtransfer.destination import Destination
from kvtransfer.grpc_transport import GrpcWriter
from kvtransfer.layout import DTYPES, KVLayout, SegmentKind
from kvtransfer.leases import LeaseTable
from kvtransfer.page_spans import cache_view, page_offset
from kvtransfer.shm_pool import SharedPagePool
from kvtransfer.shm_receiver import ShmReceiver
from kvtransfer.shm_transport import ShmWriter
from rpc.internal.v1 import kv_pb2

from .conftest import DEEPSEEK_V3, SMALL_WITH_DRAFT, random_cache


def random_layouts(seed: int, count: int) -> list[KVLayout]:
    rng = random.Random(seed)
    layouts = []
    for _ in range(count):
        draft_layers = rng.choice([0, 0, 1, 3])
        layouts.append(KVLayout(
            num_layers=rng.randint(1, 6), latent_dim=rng.randint(1, 96), rope_dim=rng.choice([0, 8, 13, 64]),
            page_size=rng.choice([1, 3, 16, 64]), dtype=rng.choice(sorted(DTYPES)),
            draft_layers=draft_layers, draft_dim=rng.randint(1, 48) if draft_layers else 0,
        ))
    return layouts


LAYOUTS = [DEEPSEEK_V3, SMALL_WITH_DRAFT, *random_layouts(seed=2024, count=3)]


def page_of(cache: PagedLatentCache, kind: SegmentKind, layer: int, page: int) -> bytes:
    """The raw bytes of one page of one layer (compared as bytes: random bits may be NaN as floats)."""
    layout, num_pages, view = cache_view(cache)
    start = page_offset(layout, num_pages, kind, layer, page)
    return bytes(view[start : start + layout.page_bytes(kind)])


def segment(cache: PagedLatentCache, kind: SegmentKind, layer: int) -> torch.Tensor:
    """[pages, page_size, row_dim] viewed as raw bytes."""
    pages = cache.layer(layer) if kind == SegmentKind.TARGET else cache.draft_layer(layer)
    return pages.view(torch.uint8)


def over_the_wire(destination: Destination) -> Destination:
    """The destination as prefill receives it inside the Prefill RPC."""
    return Destination.from_proto(kv_pb2.KVDestination.FromString(destination.to_proto().SerializeToString()))


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("transport", ["shm", "grpc"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.hash)
def test_round_trip_bytes_arrive_exact(layout, transport, tp, push_server):
    """Every reserved page of every target and draft layer holds the source page's bytes, on every rank
    (each rank's source differs, so a rank mix-up fails); pages outside the request keep their old bytes."""
    rng = random.Random(f"{layout.hash}-{transport}-{tp}")
    pool_pages = 6 if layout.num_layers > 8 else 24
    pools = [SharedPagePool.create(layout, pool_pages, rank) for rank in range(tp)]
    try:
        for pool in pools:
            pool.tensor.view(torch.uint8).fill_(0xA5)
        if transport == "shm":
            receiver, writer = ShmReceiver(pools), ShmWriter(layout)
        else:
            small = layout.pool_bytes(pool_pages) < 1 << 20  # tiny chunks (pages split across chunks) only there
            max_chunk = rng.choice([1 << 20, layout.page_bytes(SegmentKind.TARGET)] + ([1000] if small else []))
            receiver, writer = push_server([pool.cache for pool in pools]), GrpcWriter(layout, max_chunk=min(max_chunk, 1 << 20))
        num_tokens = rng.randint(1, pool_pages // 2 * layout.page_size)
        count = layout.pages_for_tokens(num_tokens)
        destination_pages = rng.sample(range(pool_pages), count)
        source_pages = rng.sample(range(count + 3), count)
        sources = [random_cache(layout, count + 3, seed=rng.randrange(1 << 30)) for _ in range(tp)]
        lease = LeaseTable().grant("request-1", destination_pages, ttl_s=60)
        destination = over_the_wire(receiver.expect(lease, num_tokens))
        for rank in range(tp):
            sent = writer.push(sources[rank], source_pages, destination, rank)
            assert sent.bytes == count * layout.bytes_per_page
        result = receiver.admit("request-1", timeout_s=10)
        assert result.bytes == tp * count * layout.bytes_per_page
        untouched = [page for page in range(pool_pages) if page not in destination_pages]
        for rank, pool in enumerate(pools):
            for kind, layer in layout.segments():
                filler = b"\xa5" * layout.page_bytes(kind)
                for sent, received in zip(source_pages, destination_pages):
                    assert page_of(pool.cache, kind, layer, received) == page_of(sources[rank], kind, layer, sent), (
                        rank, kind, layer, received)
                assert all(page_of(pool.cache, kind, layer, page) == filler for page in untouched)
        writer.close()
    finally:
        for pool in pools:
            pool.close()
            pool.unlink()


def test_prefill_writes_in_place_through_the_mapped_cache():
    """The services' fast path: prefill writes the reserved pages via handle.cache (its own forward), then
    finish() records the checksum; decode admits and sees exactly those values."""
    with SharedPagePool.create(SMALL_WITH_DRAFT, 8) as pool:
        receiver, writer = ShmReceiver([pool]), ShmWriter(SMALL_WITH_DRAFT)
        lease = LeaseTable().grant("r", [6, 1, 4], ttl_s=60)
        destination = receiver.expect(lease, 40)
        handle = writer.open(destination, in_place=True)
        values = torch.randn(2, 3, 16, 80).to(torch.bfloat16)
        for layer in range(SMALL_WITH_DRAFT.num_layers):
            handle.cache.kv[layer, [6, 1, 4]] = values[layer % 2]
        handle.cache.draft[1, 4] = 1.25
        result = handle.finish()
        assert result.bytes == 3 * SMALL_WITH_DRAFT.bytes_per_page
        assert receiver.admit("r").checksum == result.checksum
        assert torch.equal(pool.cache.kv[3, [6, 1, 4]], values[1])
        assert pool.cache.draft[1, 4].eq(1.25).all()
        writer.close()


def test_chunked_prefill_writes_in_any_order():
    """Pages written chunk by chunk (later chunk first, layers interleaved, a page rewritten) still verify."""
    layout = SMALL_WITH_DRAFT
    with SharedPagePool.create(layout, 10) as pool:
        receiver, writer = ShmReceiver([pool]), ShmWriter(layout)
        source = random_cache(layout, 4, seed=3)
        lease = LeaseTable().grant("r", [9, 2, 3, 5], ttl_s=60)
        destination = receiver.expect(lease, 64)
        with writer.open(destination) as handle:
            for first, count in [(2, 2), (0, 3)]:  # pages 2..3 first, then 0..2 (page 2 written twice)
                for kind, layer in reversed(layout.segments()):
                    pages = source.layer(layer) if kind == SegmentKind.TARGET else source.draft_layer(layer)
                    handle.write_pages(kind, layer, first, pages[first : first + count])
            handle.finish()
        receiver.admit("r")
        for kind, layer in layout.segments():
            assert torch.equal(segment(pool.cache, kind, layer)[[9, 2, 3, 5]], segment(source, kind, layer)[:4])
        writer.close()
