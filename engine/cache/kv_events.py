"""KV events: what enters and leaves an engine's prefix cache, numbered, for whoever routes by cache contents.

The prefix cache (engine/cache/prefix_cache.py) records into a KVEventLog under its own lock; the log keeps the
last `capacity` events with a sequence number (1, 2, ... per log instance, no gaps) and the contents they add up to
(KVContents), so that snapshot() and the sequence number it carries are taken together. A reader that knows a
sequence number still in the buffer reads the events after it (read); one that does not (0, too old, or another
instance: the engine restarted) starts again from a snapshot. Events:

- PageStored(key, parent, num_tokens, has_draft): a full page published under `key`, chained from `parent` (the
  root key for a first page), with the draft model's context or not;
- PageRemoved(key): the page was evicted (its checkpoint, if any, went with it);
- CheckpointStored(key) / CheckpointRemoved(key): a KDA state checkpoint at the end of page `key` came / went;
- Cleared(root, page_size, needs_checkpoints): the cache is empty (the first event of every log: a new cache).

The log is torch-free (the gateway's index applies the same events: gateway/kv_index.py). Recording costs one
lock, a deque append and a dict update per event; nothing waits on a reader (a slow one falls behind the buffer
and takes a snapshot). A waker (set_waker) is called once after the first event a reader has not seen yet (the
reader's read() re-arms it): how a worker's event loop learns of events recorded on the engine thread."""
from __future__ import annotations

import collections
import itertools
import threading
import uuid
from collections.abc import Callable, Iterable
from typing import NamedTuple, Union


class PageStored(NamedTuple):
    key: bytes
    parent: bytes
    num_tokens: int
    has_draft: bool


class PageRemoved(NamedTuple):
    key: bytes


class CheckpointStored(NamedTuple):
    key: bytes


class CheckpointRemoved(NamedTuple):
    key: bytes


class Cleared(NamedTuple):
    root: bytes
    page_size: int
    needs_checkpoints: bool = False  # a hit is usable only up to a checkpointed page (models with KDA layers)


KVEvent = Union[PageStored, PageRemoved, CheckpointStored, CheckpointRemoved, Cleared]
Numbered = tuple[int, KVEvent]  # (sequence number, event)


class KVSnapshot(NamedTuple):
    """A cache's whole contents as of event `sequence` of log `instance_id`."""

    instance_id: str
    sequence: int
    root: bytes
    page_size: int
    pages: tuple[PageStored, ...]
    checkpoints: tuple[bytes, ...]
    needs_checkpoints: bool = False


class KVContents:
    """The set of pages (and checkpoints) a stream of events adds up to. Not thread-safe (its owner locks)."""

    def __init__(self, root: bytes = b"", page_size: int = 0, needs_checkpoints: bool = False) -> None:
        self.root, self.page_size, self.needs_checkpoints = root, page_size, needs_checkpoints
        self.pages: dict[bytes, PageStored] = {}
        self.checkpoints: set[bytes] = set()

    def apply(self, event: KVEvent) -> None:
        if isinstance(event, PageStored):
            self.pages[event.key] = event
        elif isinstance(event, PageRemoved):
            self.pages.pop(event.key, None)
            self.checkpoints.discard(event.key)
        elif isinstance(event, CheckpointStored):
            self.checkpoints.add(event.key)
        elif isinstance(event, CheckpointRemoved):
            self.checkpoints.discard(event.key)
        elif isinstance(event, Cleared):
            self.root, self.page_size, self.needs_checkpoints = event.root, event.page_size, event.needs_checkpoints
            self.pages.clear()
            self.checkpoints.clear()
        else:
            raise TypeError(f"not a KV event: {event!r}")

    def load(self, snapshot: KVSnapshot) -> None:
        self.root, self.page_size, self.needs_checkpoints = snapshot.root, snapshot.page_size, snapshot.needs_checkpoints
        self.pages = {page.key: page for page in snapshot.pages}
        self.checkpoints = set(snapshot.checkpoints)

    def snapshot(self, instance_id: str, sequence: int) -> KVSnapshot:
        return KVSnapshot(instance_id, sequence, self.root, self.page_size, tuple(self.pages.values()),
                          tuple(self.checkpoints), self.needs_checkpoints)


class KVEventLog:
    """The numbered events of one cache instance and the contents they add up to (thread-safe).

    root / page_size / needs_checkpoints: the cache's (recorded as the first event, Cleared); instance_id: a new random one by default
    (a mirror of another process's log adopts that log's id with its snapshot: adopt())."""

    def __init__(self, root: bytes = b"", page_size: int = 0, needs_checkpoints: bool = False, capacity: int = 65536,
                 instance_id: str | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.instance_id = instance_id or uuid.uuid4().hex[:16]
        self._lock = threading.Lock()
        self._buffer: collections.deque[Numbered] = collections.deque(maxlen=capacity)
        self._contents = KVContents(root, page_size, needs_checkpoints)
        self._sequence = 0
        self._waker: Callable[[], None] | None = None
        self._woken = False  # the waker was called and no read() came since
        self.record(Cleared(root, page_size, needs_checkpoints))

    @property
    def sequence(self) -> int:
        return self._sequence

    def record(self, event: KVEvent) -> None:
        with self._lock:
            self._sequence += 1
            self._buffer.append((self._sequence, event))
            self._contents.apply(event)
            waker = self._waker
            if waker is None or self._woken:
                return
            self._woken = True
        waker()

    def read(self, after: int, limit: int = 4096) -> list[Numbered] | None:
        """Up to `limit` events after sequence number `after`, oldest first ([] when none); None when the buffer
        no longer holds the one after it (or `after` is not one of this log's numbers): take a snapshot()."""
        with self._lock:
            self._woken = False
            if after == self._sequence:
                return []
            first = self._buffer[0][0] if self._buffer else self._sequence + 1
            if after < first - 1 or after > self._sequence:
                return None
            start = after - first + 1
            return list(itertools.islice(self._buffer, start, start + limit))

    def snapshot(self) -> KVSnapshot:
        with self._lock:
            self._woken = False
            return self._contents.snapshot(self.instance_id, self._sequence)

    def set_waker(self, waker: Callable[[], None] | None) -> None:
        """waker(): called (from the recording thread, outside the log's lock) after an event no read() saw yet."""
        with self._lock:
            self._waker, self._woken = waker, False

    # --- a mirror of another process's log (the decode worker's, fed by its engine process) ----------------------
    def adopt(self, snapshot: KVSnapshot) -> None:
        """Becomes a copy of `snapshot`'s log as of its sequence number (readers before it take a snapshot)."""
        with self._lock:
            self.instance_id, self._sequence = snapshot.instance_id, snapshot.sequence
            self._buffer.clear()
            self._contents.load(snapshot)
            waker, self._woken = self._waker, self._waker is not None
        if waker is not None:
            waker()

    def extend(self, instance_id: str, events: Iterable[Numbered]) -> bool:
        """Appends another log's events with their numbers; False (nothing appended) when they do not follow
        this log's last one (another instance, or a gap): the caller must adopt() a snapshot first."""
        events = list(events)
        with self._lock:
            if instance_id != self.instance_id or (events and events[0][0] != self._sequence + 1):
                return False
            for number, event in events:
                self._buffer.append((number, event))
                self._contents.apply(event)
            if events:
                self._sequence = events[-1][0]
            waker = self._waker if events and not self._woken else None
            self._woken = self._woken or waker is not None
        if waker is not None:
            waker()
        return True


class KVEventForwarder:
    """Carries a log to another process in order: each take() returns what the other side lacks since the last
    one (a snapshot first, and whenever the buffer lost events it had not taken yet) or None."""

    def __init__(self, log: KVEventLog) -> None:
        self._log = log
        self._sent = -1  # nothing sent: a snapshot first

    def take(self) -> KVSnapshot | tuple[str, list[Numbered]] | None:
        log = self._log
        events = log.read(self._sent, limit=1 << 30) if self._sent >= 0 else None
        if events is None:
            snapshot = log.snapshot()
            self._sent = snapshot.sequence
            return snapshot
        if not events:
            return None
        self._sent = events[-1][0]
        return log.instance_id, events
