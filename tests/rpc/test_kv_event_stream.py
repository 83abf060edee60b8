"""WatchKVEvents (rpc/kv_event_stream.py) over a real in-process grpc.aio server, its log written from another
thread as a prefill worker's engine thread writes it.

Invariants: an unknown watcher (0, another instance) gets a snapshot first, a known one exactly the events after
its sequence number; batches follow each other without a gap; a watcher behind the bounded buffer gets a snapshot
again; events recorded on another thread wake the stream; close() ends every stream."""
from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc

from engine.cache.kv_events import KVEventLog, PageStored
from rpc.internal.v1 import worker_pb2, worker_pb2_grpc
from rpc.kv_event_stream import KVEventPublisher, KVEventServicer
from tests.services.helpers import eventually

PAGE = 4


def _page(number: int) -> PageStored:
    return PageStored(number.to_bytes(16, "little"), b"r" * 16, PAGE, False)


@asynccontextmanager
async def serving(log: KVEventLog) -> AsyncIterator[tuple[worker_pb2_grpc.KVEventServiceStub, KVEventPublisher]]:
    publisher = KVEventPublisher(lambda: log)
    server = grpc.aio.server()
    worker_pb2_grpc.add_KVEventServiceServicer_to_server(KVEventServicer(publisher), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield worker_pb2_grpc.KVEventServiceStub(channel), publisher
    finally:
        publisher.close()
        await server.stop(grace=None)


async def test_snapshot_first_then_events_from_another_thread():
    """A fresh watcher: a snapshot of the two pages held, then the events a thread records, in order, no gap."""
    log = KVEventLog(b"r" * 16, PAGE)
    log.record(_page(1))
    log.record(_page(2))
    async with serving(log) as (stub, _):
        call = stub.WatchKVEvents(worker_pb2.WatchKVEventsRequest(), timeout=60)
        stream = call.__aiter__()
        first = await stream.__anext__()
        assert first.HasField("snapshot") and first.instance_id == log.instance_id
        assert first.snapshot.sequence == 3 and len(first.snapshot.pages) == 2 and first.snapshot.page_size == PAGE
        writer = threading.Thread(target=lambda: [log.record(_page(n)) for n in range(3, 23)])
        writer.start()
        numbers: list[int] = []
        while len(numbers) < 20:
            batch = await stream.__anext__()
            assert not batch.HasField("snapshot")
            numbers += [event.sequence for event in batch.events]
        writer.join()
        assert numbers == list(range(4, 24))
        call.cancel()


async def test_known_position_resumes_and_unknown_or_old_gets_a_snapshot():
    """after_sequence of this instance resumes with the next event; another instance's id, or a number the bounded
    buffer no longer holds, gets a snapshot (negative control: the known one gets none)."""
    log = KVEventLog(b"r" * 16, PAGE, capacity=4)
    for number in range(1, 4):
        log.record(_page(number))  # sequence 2..4
    async with serving(log) as (stub, _):
        async def first(instance_id: str, after: int) -> worker_pb2.WatchKVEventsResponse:
            call = stub.WatchKVEvents(worker_pb2.WatchKVEventsRequest(instance_id=instance_id, after_sequence=after),
                                      timeout=60)
            async for batch in call:
                call.cancel()
                return batch
            raise AssertionError("no batch")

        resumed = await first(log.instance_id, 2)
        assert not resumed.HasField("snapshot") and [e.sequence for e in resumed.events] == [3, 4]
        assert (await first("another", 2)).HasField("snapshot")
        for number in range(4, 10):
            log.record(_page(number))  # the buffer now starts after 2
        old = await first(log.instance_id, 2)
        assert old.HasField("snapshot") and old.snapshot.sequence == log.sequence and len(old.snapshot.pages) == 9


async def test_close_ends_every_stream():
    """Shutdown: a watcher waiting for events sees its stream end (the server's grace period need not wait)."""
    log = KVEventLog(b"r" * 16, PAGE)
    async with serving(log) as (stub, publisher):
        call = stub.WatchKVEvents(worker_pb2.WatchKVEventsRequest(), timeout=60)
        received = []

        async def drain() -> None:
            async for batch in call:
                received.append(batch)

        task = asyncio.create_task(drain())
        await eventually(lambda: bool(received), "the snapshot")
        publisher.close()
        await asyncio.wait_for(task, 30)
        assert len(received) == 1 and await call.code() == grpc.StatusCode.OK
