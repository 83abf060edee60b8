"""32 transfers at once (threads), over shm and grpc, into one decode pool: all arrive exact; with one
corrupted chunk among them only that request fails and only its pages go back."""
from __future__ import annotations

import random
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from engine.cache.kv_cache import PageAllocator
from kvtransfer.chunks import WireChunk
from kvtransfer.errors import ChecksumMismatch
from kvtransfer.grpc_transport import GrpcWriter
from kvtransfer.leases import LeaseTable
from kvtransfer.shm_pool import SharedPagePool
from kvtransfer.shm_receiver import ShmReceiver
from kvtransfer.shm_transport import ShmWriter

from .conftest import SMALL_WITH_DRAFT, random_cache

LAYOUT = SMALL_WITH_DRAFT
REQUESTS = 32


@pytest.mark.parametrize("transport", ["shm", "grpc"])
def test_32_concurrent_transfers_all_exact(transport, push_server, monkeypatch):
    """32 threads each push a request (1-4 pages, own random bytes) at once; every page arrives exact. Over
    grpc, request 7's fourth chunk is corrupted in flight: it alone fails and its pages are freed."""
    rng = random.Random(transport)
    with SharedPagePool.create(LAYOUT, REQUESTS * 4) as pool:
        allocator, leases, failed, held, lock = PageAllocator(REQUESTS * 4), LeaseTable(), [], {}, threading.Lock()

        def on_failed(request_id: str) -> None:
            with lock:
                failed.append(request_id)
                allocator.free(held.pop(request_id))

        if transport == "shm":
            receiver, writer = ShmReceiver([pool], on_failed=on_failed), ShmWriter(LAYOUT)
        else:
            receiver, writer = push_server([pool.cache], on_failed=on_failed), GrpcWriter(LAYOUT, max_chunk=4096)
        jobs = []
        for index in range(REQUESTS):
            tokens = rng.randint(1, 4 * LAYOUT.page_size)
            pages = allocator.allocate(LAYOUT.pages_for_tokens(tokens))
            held[f"r{index}"] = pages
            destination = receiver.expect(leases.grant(f"r{index}", pages, 60), tokens)
            jobs.append((destination, random_cache(LAYOUT, len(pages), seed=index)))
        corrupt = "r7" if transport == "grpc" else None
        if corrupt:  # before the writer opens its channel, which binds the serializer
            corrupt_in_flight(monkeypatch, corrupt)

        def run(job) -> str:
            destination, source = job
            writer.push(source, list(range(len(destination.page_ids))), destination)
            return destination.request_id

        with ThreadPoolExecutor(max_workers=REQUESTS) as pool_threads:
            outcomes = list(pool_threads.map(lambda job: _catch(run, job), jobs))
        for (destination, source), outcome in zip(jobs, outcomes):
            if destination.request_id == corrupt:
                assert isinstance(outcome, Exception)
                with pytest.raises(ChecksumMismatch):
                    receiver.admit(corrupt)
                continue
            assert outcome == destination.request_id
            assert receiver.admit(destination.request_id, timeout_s=10).bytes == len(destination.page_ids) * LAYOUT.bytes_per_page
            pages = list(destination.page_ids)
            assert torch.equal(pool.cache.kv[:, pages].view(torch.uint8), source.kv.view(torch.uint8))
            assert torch.equal(pool.cache.draft[:, pages].view(torch.uint8), source.draft.view(torch.uint8))
        assert failed == ([corrupt] if corrupt else [])
        in_use = sum(len(pages) for pages in held.values())
        assert allocator.num_free == REQUESTS * 4 - in_use
        writer.close()


def _catch(function, argument):
    try:
        return function(argument)
    except Exception as error:  # noqa: BLE001 - the test inspects it
        return error


def corrupt_in_flight(monkeypatch, request_id: str) -> None:
    """Flips a payload bit of the 4th chunk of one request as the client serializes it (a wire fault)."""
    import kvtransfer.grpc_transport as grpc_transport

    original = grpc_transport.encode_chunk
    streams: dict[int, str] = {}  # serializing thread -> request id (each call has its own thread)

    def faulty(chunk: WireChunk) -> bytes:
        key = threading.get_ident()
        if chunk.header.request_id:
            streams[key] = chunk.header.request_id
        if streams.get(key) == request_id and chunk.header.sequence == 3:
            payload = bytearray(b"".join(chunk.pieces))
            payload[0] ^= 1
            chunk = WireChunk(chunk.header, bytes(payload))
        return original(chunk)

    monkeypatch.setattr(grpc_transport, "encode_chunk", faulty)
