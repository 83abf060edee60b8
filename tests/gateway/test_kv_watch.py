"""The gateway's KV watcher (gateway/kv_watch.py) against a scripted in-process KVEventService.

Invariants: a batch with a gap makes the watcher subscribe again from nothing (instance "", sequence 0) and the
index then holds the new snapshot; a stream that fails empties the worker's entry and the watcher reconnects (with
backoff) until a snapshot refills it; close() ends the watcher."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc

from gateway.kv_index import KVIndex
from gateway.kv_watch import KVWatch
from rpc.internal.v1 import worker_pb2, worker_pb2_grpc
from tests.services.helpers import eventually

KEY_A, KEY_B = b"a" * 16, b"b" * 16


def _snapshot(instance: str, sequence: int, keys: list[bytes]) -> worker_pb2.WatchKVEventsResponse:
    return worker_pb2.WatchKVEventsResponse(instance_id=instance, snapshot=worker_pb2.KVSnapshot(
        sequence=sequence, root_key=b"r" * 16, page_size=4,
        pages=[worker_pb2.KVPageStored(key=key, parent_key=b"r" * 16, num_tokens=4) for key in keys]))


def _stored(instance: str, sequence: int, key: bytes) -> worker_pb2.WatchKVEventsResponse:
    return worker_pb2.WatchKVEventsResponse(instance_id=instance, events=[worker_pb2.KVEvent(
        sequence=sequence, stored=worker_pb2.KVPageStored(key=key, parent_key=b"r" * 16, num_tokens=4))])


class Scripted(worker_pb2_grpc.KVEventServiceServicer):
    """Call i answers script[i] (a list of batches, then: hold the stream open, or fail it UNAVAILABLE)."""

    def __init__(self, script: list[tuple[list[worker_pb2.WatchKVEventsResponse], str]]) -> None:
        self.script = script
        self.requests: list[worker_pb2.WatchKVEventsRequest] = []

    async def WatchKVEvents(self, request, context):
        self.requests.append(request)
        batches, then = self.script[min(len(self.requests), len(self.script)) - 1]
        for batch in batches:
            yield batch
        if then == "fail":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "worker going away")
        await asyncio.Event().wait()  # hold


@asynccontextmanager
async def watching(servicer: Scripted) -> AsyncIterator[tuple[KVWatch, str]]:
    server = grpc.aio.server()
    worker_pb2_grpc.add_KVEventServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    address = f"127.0.0.1:{port}"
    channel = grpc.aio.insecure_channel(address)
    watch = KVWatch(KVIndex(), [(address, channel)], ())
    watch.start()
    try:
        yield watch, address
    finally:
        await watch.close()
        await channel.close()
        await server.stop(grace=None)


async def test_gap_resubscribes_for_a_snapshot():
    """snapshot(1), event 2, event 4 (3 is missing) -> the watcher asks again from nothing (once) and holds the
    second snapshot."""
    servicer = Scripted([([_snapshot("i1", 1, []), _stored("i1", 2, KEY_A), _stored("i1", 4, KEY_B)], "hold"),
                         ([_snapshot("i1", 9, [KEY_A, KEY_B])], "hold")])
    async with watching(servicer) as (watch, address):
        await eventually(lambda: len(servicer.requests) == 2 and watch.index.position(address) == ("i1", 9),
                         "the second snapshot")
        assert watch.resyncs == 1 and watch.index.cache_of(address).pages == {KEY_A, KEY_B}
        assert (servicer.requests[1].instance_id, servicer.requests[1].after_sequence) == ("", 0)


async def test_failed_stream_forgets_and_reconnects():
    """A stream failing UNAVAILABLE after a snapshot of one page empties the entry; the reconnection's snapshot
    (another instance: the worker restarted) fills it with that instance's pages only."""
    servicer = Scripted([([_snapshot("old", 5, [KEY_A])], "fail"), ([_snapshot("new", 1, [KEY_B])], "hold")])
    async with watching(servicer) as (watch, address):
        await eventually(lambda: watch.index.position(address) == ("new", 1), "the new instance's snapshot")
        assert watch.losses >= 1 and watch.index.cache_of(address).pages == {KEY_B}
