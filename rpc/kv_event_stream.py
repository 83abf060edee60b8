"""WatchKVEvents on a worker: one prefix cache's KV event log (engine/cache/kv_events.py, duck-typed here: floor 0
imports no engine) streamed as WatchKVEventsResponse messages.

A watcher whose instance id and sequence number the log still knows gets the events after that number; any other
(0, too old, another instance) gets a full snapshot first. Then every batch follows the previous one without a gap
(a watcher that falls behind the log's buffer gets a snapshot again). The log may be written on another thread
(the prefill worker's engine thread): its waker wakes this loop, once per unread batch."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Protocol

import grpc

from rpc.internal.v1 import worker_pb2, worker_pb2_grpc

BATCH_EVENTS = 4096  # events per message at most


class SnapshotLike(Protocol):
    instance_id: str
    sequence: int
    root: bytes
    page_size: int
    pages: Sequence[Any]  # PageStored-like: key, parent, num_tokens, has_draft
    checkpoints: Sequence[bytes]
    needs_checkpoints: bool


class EventLog(Protocol):
    """What this module reads of an engine.cache.kv_events.KVEventLog."""

    instance_id: str

    def read(self, after: int, limit: int = ...) -> list[tuple[int, Any]] | None: ...
    def snapshot(self) -> SnapshotLike: ...
    def set_waker(self, waker: Callable[[], None] | None) -> None: ...


def _page(event: Any) -> worker_pb2.KVPageStored:
    return worker_pb2.KVPageStored(key=event.key, parent_key=event.parent, num_tokens=event.num_tokens,
                                   has_draft=event.has_draft)


def event_to_proto(sequence: int, event: Any) -> worker_pb2.KVEvent:
    """One numbered event (its kind named by its class: PageStored, PageRemoved, CheckpointStored,
    CheckpointRemoved, Cleared)."""
    kind = type(event).__name__
    message = worker_pb2.KVEvent(sequence=sequence)
    if kind == "PageStored":
        message.stored.CopyFrom(_page(event))
    elif kind == "PageRemoved":
        message.removed = event.key
    elif kind == "CheckpointStored":
        message.checkpoint_stored = event.key
    elif kind == "CheckpointRemoved":
        message.checkpoint_removed = event.key
    elif kind == "Cleared":
        message.cleared.CopyFrom(worker_pb2.KVCleared(root_key=event.root, page_size=event.page_size,
                                                      needs_checkpoints=event.needs_checkpoints))
    else:
        raise TypeError(f"not a KV event: {event!r}")
    return message


def snapshot_to_proto(snapshot: SnapshotLike) -> worker_pb2.WatchKVEventsResponse:
    return worker_pb2.WatchKVEventsResponse(instance_id=snapshot.instance_id, snapshot=worker_pb2.KVSnapshot(
        sequence=snapshot.sequence, root_key=snapshot.root, page_size=snapshot.page_size,
        pages=[_page(page) for page in snapshot.pages], checkpoint_keys=list(snapshot.checkpoints),
        needs_checkpoints=snapshot.needs_checkpoints))


class KVEventPublisher:
    """Streams one log to any number of watchers. log(): the log to serve (looked up per watch: a worker's engine
    may be built after its server)."""

    def __init__(self, log: Callable[[], EventLog]) -> None:
        self._log = log
        self._attached: EventLog | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed = asyncio.Event()
        self._closed = False

    def close(self) -> None:
        """Shutdown: every watch ends (the server's grace period does not wait for them)."""
        self._closed = True
        self._wake()
        self.detach()

    def _attach(self, log: EventLog) -> None:
        if self._attached is log:
            return
        if self._attached is not None:
            self._attached.set_waker(None)
        self._loop = asyncio.get_running_loop()
        self._attached = log
        log.set_waker(self._wake_threadsafe)

    def detach(self) -> None:
        if self._attached is not None:
            self._attached.set_waker(None)
            self._attached = None

    def _wake_threadsafe(self) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def watch(self, instance_id: str, after: int) -> AsyncIterator[worker_pb2.WatchKVEventsResponse]:
        """The batches for a watcher that last saw event `after` of instance `instance_id`."""
        log = self._log()
        self._attach(log)
        known = instance_id == log.instance_id and after > 0
        while not self._closed:
            changed = self._changed
            events = log.read(after, BATCH_EVENTS) if known and log.instance_id == instance_id else None
            if events is None:
                snapshot = log.snapshot()
                instance_id, after, known = snapshot.instance_id, snapshot.sequence, True
                yield snapshot_to_proto(snapshot)
            elif events:
                after = events[-1][0]
                yield worker_pb2.WatchKVEventsResponse(instance_id=instance_id,
                                              events=[event_to_proto(number, event) for number, event in events])
            else:
                await changed.wait()


class KVEventServicer(worker_pb2_grpc.KVEventServiceServicer):
    """The KVEventService of a worker (registered beside its own service)."""

    def __init__(self, publisher: KVEventPublisher) -> None:
        self._publisher = publisher

    async def WatchKVEvents(self, request: worker_pb2.WatchKVEventsRequest,
                            context: grpc.aio.ServicerContext) -> AsyncIterator[worker_pb2.WatchKVEventsResponse]:
        async for batch in self._publisher.watch(request.instance_id, request.after_sequence):
            yield batch
