"""KV events (engine/cache/kv_events.py) and the prefix cache's recording of them.

Invariants: sequence numbers start at 1 (Cleared) and grow by one per event; read(after) returns exactly the events
after `after` while the buffer holds them and None (take a snapshot) once it does not, or for a number the log
never had; a snapshot and its sequence number describe the same contents; a mirror fed by a forwarder ends equal to
the log; the page keys a router computes (page_keys.py) are the keys the cache publishes under."""
from __future__ import annotations

import pytest

from engine.cache.kv_cache import PageAllocator, PageTable
from engine.cache.kv_events import (CheckpointRemoved, CheckpointStored, Cleared, KVContents, KVEventForwarder,
                                    KVEventLog, KVSnapshot, PageRemoved, PageStored)
from engine.cache.page_keys import page_keys, root_key
from engine.cache.prefix_cache import PrefixCache

PAGE = 4


def _stored(key: bytes, parent: bytes = b"r") -> PageStored:
    return PageStored(key, parent, PAGE, False)


def test_sequence_numbers_and_reads():
    """Cleared is event 1; read returns what follows a number, [] at the head, None for unknown numbers."""
    log = KVEventLog(b"r", PAGE)
    assert log.sequence == 1 and log.read(0) == [(1, Cleared(b"r", PAGE))]
    log.record(_stored(b"a"))
    log.record(_stored(b"b", b"a"))
    assert log.read(1) == [(2, _stored(b"a")), (3, _stored(b"b", b"a"))]
    assert log.read(2, limit=1) == [(3, _stored(b"b", b"a"))]
    assert log.read(3) == []
    assert log.read(4) is None  # a number this log never gave (another instance's)


def test_overflow_forces_a_snapshot():
    """A bounded buffer: a reader behind it gets None, and the snapshot holds what the events added up to."""
    log = KVEventLog(b"r", PAGE, capacity=2)
    for key in (b"a", b"b", b"c"):
        log.record(_stored(key))
    log.record(PageRemoved(b"b"))
    assert log.read(1) is None and log.read(2) is None
    assert log.read(3) == [(4, _stored(b"c")), (5, PageRemoved(b"b"))]
    snapshot = log.snapshot()
    assert snapshot.sequence == 5 and snapshot.root == b"r" and snapshot.page_size == PAGE
    assert {page.key for page in snapshot.pages} == {b"a", b"c"}


def test_contents_apply_every_kind():
    """Removal of a page takes its checkpoint; Cleared empties; a checkpoint can go on its own."""
    contents = KVContents()
    for event in (Cleared(b"r", PAGE), _stored(b"a"), _stored(b"b", b"a"), CheckpointStored(b"a"),
                  CheckpointStored(b"b"), CheckpointRemoved(b"b"), PageRemoved(b"a")):
        contents.apply(event)
    assert set(contents.pages) == {b"b"} and contents.checkpoints == set()
    contents.apply(Cleared(b"x", 8))
    assert contents.pages == {} and contents.root == b"x" and contents.page_size == 8
    with pytest.raises(TypeError):
        contents.apply(("not", "an event"))  # type: ignore[arg-type]


def test_waker_called_once_per_unread_batch():
    """The waker fires on the first event nobody read yet, not again until a read."""
    log = KVEventLog(b"r", PAGE)
    calls = []
    log.set_waker(lambda: calls.append(log.sequence))
    log.record(_stored(b"a"))
    log.record(_stored(b"b"))
    assert calls == [2]
    log.read(1)
    log.record(_stored(b"c"))
    assert calls == [2, 4]


def test_forwarder_and_mirror_agree():
    """Snapshot first, then events in order; a mirror adopting / extending ends with the log's contents; a
    forwarder that fell behind the buffer sends a snapshot again; extend refuses a gap or another instance."""
    log = KVEventLog(b"r", PAGE, capacity=3)
    forwarder = KVEventForwarder(log)
    mirror = KVEventLog()
    first = forwarder.take()
    mirror.adopt(first)
    assert mirror.instance_id == log.instance_id and mirror.sequence == log.sequence
    log.record(_stored(b"a"))
    instance, events = forwarder.take()
    assert mirror.extend(instance, events) and forwarder.take() is None
    for key in (b"b", b"c", b"d", b"e"):
        log.record(_stored(key))
    again = forwarder.take()
    assert isinstance(again, KVSnapshot)  # the buffer lost the event of b: a snapshot again
    mirror.adopt(again)
    assert mirror.snapshot().pages == log.snapshot().pages
    log.record(PageRemoved(b"a"))
    instance, events = forwarder.take()
    assert not mirror.extend("another", events)
    assert not mirror.extend(instance, [(events[0][0] + 1, events[0][1])])  # a gap
    assert mirror.extend(instance, events)
    assert set(page.key for page in mirror.snapshot().pages) == {b"b", b"c", b"d", b"e"}


def test_prefix_cache_records_what_it_publishes_and_evicts():
    """The cache's publish / evict / checkpoint calls produce the events; keys equal page_keys() of the tokens."""
    allocator = PageAllocator(4)
    cache = PrefixCache(allocator, PAGE, "salt", num_checkpoints=1, needs_checkpoints=True, checkpoint_interval=PAGE)
    tokens = list(range(10))
    table = PageTable(allocator, PAGE)
    table.ensure(len(tokens))
    cache.publish(table, tokens, len(tokens), has_draft=True)
    expected = page_keys(root_key("salt"), tokens, PAGE)
    assert len(expected) == 2 and table.cache_keys == expected
    events = [event for _, event in cache.events.read(0)]
    assert events == [Cleared(cache.root, PAGE, True), PageStored(expected[0], cache.root, PAGE, True),
                      PageStored(expected[1], expected[0], PAGE, True)]
    assert cache.save_checkpoint(expected[0]) is not None
    assert cache.save_checkpoint(expected[1]) is not None  # takes the only slot from the first page
    assert [event for _, event in cache.events.read(3)] == [
        CheckpointStored(expected[0]), CheckpointRemoved(expected[0]), CheckpointStored(expected[1])]
    cache.check_consistency()
    table.release()
    assert cache.evict() is not None  # the leaf (page 2) goes first
    assert cache.events.read(6) == [(7, PageRemoved(expected[1]))]
    cache.check_consistency()
    snapshot = cache.events.snapshot()
    assert [page.key for page in snapshot.pages] == expected[:1] and snapshot.checkpoints == ()


def test_events_off_records_nothing():
    """kv_events=False: no log (the cost-free configuration the decode-step measurement compares against)."""
    cache = PrefixCache(PageAllocator(2), PAGE, "salt", kv_events=False)
    assert cache.events is None


def test_page_keys_bad_input():
    """A page size of 0 is refused by name; max_tokens limits the keys to full pages inside it."""
    with pytest.raises(ValueError, match="page_size"):
        page_keys(b"r", [1, 2, 3], 0)
    assert len(page_keys(b"r", list(range(12)), PAGE, max_tokens=11)) == 2
