"""The gateway's KV index (gateway/kv_index.py), fed with WatchKVEventsResponse messages built by the workers' own code
(rpc/kv_event_stream.py over an engine KVEventLog).

Invariants: a snapshot replaces what was known; events apply only in order and of the same instance: a gap or an
instance change without a snapshot empties the worker's entry and asks for a resubscription (apply -> False); a
removal takes the page (and its checkpoint) out; overlap counts the prompt's leading held pages with the engine's
own keys, up to all but the prompt's last token, and for a model with checkpoints a prefill-side hit stops at the
last checkpointed page."""
from __future__ import annotations

from engine.cache.kv_events import CheckpointStored, KVEventLog, PageRemoved, PageStored
from engine.cache.page_keys import page_keys
from gateway.kv_index import KVIndex, Overlap, PromptKeys
from rpc.internal.v1 import worker_pb2
from rpc.kv_event_stream import event_to_proto, snapshot_to_proto

PAGE = 4
ROOT = b"r" * 16
PROMPT = list(range(100, 118))  # 18 tokens: 4 full pages inside all but the last token


def _publish(log: KVEventLog, tokens: list[int], pages: int) -> list[bytes]:
    keys = page_keys(log.snapshot().root, tokens, PAGE)[:pages]
    parent = log.snapshot().root
    for key in keys:
        log.record(PageStored(key, parent, PAGE, False))
        parent = key
    return keys


def _batch(log: KVEventLog, after: int) -> worker_pb2.WatchKVEventsResponse:
    return worker_pb2.WatchKVEventsResponse(instance_id=log.instance_id,
                                   events=[event_to_proto(n, e) for n, e in log.read(after)])


def test_snapshot_then_events_and_overlap():
    """A snapshot of 2 pages, then 2 more pages by events: the prompt overlaps 4 pages (16 tokens); a removal of
    the third page cuts the overlap to 2 pages."""
    log = KVEventLog(ROOT, PAGE)
    keys = _publish(log, PROMPT, 2)
    index = KVIndex()
    assert index.apply("w", snapshot_to_proto(log.snapshot()))
    after = log.sequence
    keys += _publish(log, PROMPT, 4)[2:]
    assert index.apply("w", _batch(log, after))
    prompt = PromptKeys(PROMPT)
    assert index.overlap("w", prompt) == Overlap(16, 16)
    after = log.sequence
    log.record(PageRemoved(keys[2]))
    assert index.apply("w", _batch(log, after))
    assert index.overlap("w", prompt) == Overlap(8, 8)
    assert index.position("w") == (log.instance_id, log.sequence)


def test_gap_and_new_instance_force_a_resubscription():
    """A batch that skips a sequence number, or comes from another instance without a snapshot, is refused and
    empties the entry (negative control: the in-order batch before it was accepted)."""
    log = KVEventLog(ROOT, PAGE)
    index = KVIndex()
    assert index.apply("w", snapshot_to_proto(log.snapshot()))
    _publish(log, PROMPT, 3)
    events = log.read(1)
    in_order = worker_pb2.WatchKVEventsResponse(instance_id=log.instance_id, events=[event_to_proto(*events[0])])
    assert index.apply("w", in_order)
    gap = worker_pb2.WatchKVEventsResponse(instance_id=log.instance_id, events=[event_to_proto(*events[2])])
    assert not index.apply("w", gap)
    assert index.cache_of("w") is None and index.position("w") == ("", 0)
    assert index.apply("w", snapshot_to_proto(log.snapshot()))  # the resubscription's snapshot
    assert index.overlap("w", PromptKeys(PROMPT)).page_tokens == 12
    restarted = KVEventLog(ROOT, PAGE)  # a new instance (a restarted worker)
    assert not index.apply("w", _batch(restarted, 0))
    assert index.overlap("w", PromptKeys(PROMPT)) == Overlap()


def test_restart_snapshot_leaves_no_stale_entry():
    """A new instance's snapshot replaces everything: the old instance's pages are gone."""
    old, new = KVEventLog(ROOT, PAGE), KVEventLog(ROOT, PAGE)
    _publish(old, PROMPT, 4)
    index = KVIndex()
    index.apply("w", snapshot_to_proto(old.snapshot()))
    assert index.overlap("w", PromptKeys(PROMPT)).page_tokens == 16
    index.apply("w", snapshot_to_proto(new.snapshot()))
    assert index.cache_of("w").pages == set() and index.position("w") == (new.instance_id, 1)


def test_overlap_stops_before_the_last_token_and_at_checkpoints():
    """A prompt of exactly 4 pages maps at most 3 (its last token is always computed); with needs_checkpoints a
    prefill-side hit ends at the last checkpointed page while the page overlap does not."""
    log = KVEventLog(ROOT, PAGE, needs_checkpoints=True)
    keys = _publish(log, PROMPT, 4)
    log.record(CheckpointStored(keys[1]))
    index = KVIndex()
    index.apply("w", snapshot_to_proto(log.snapshot()))
    assert index.overlap("w", PromptKeys(PROMPT[:16])) == Overlap(12, 8)
    assert index.overlap("w", PromptKeys(PROMPT)) == Overlap(16, 8)
    assert index.overlap("w", PromptKeys([7] + PROMPT)) == Overlap()  # another first page: no overlap
    assert index.overlap("unknown", PromptKeys(PROMPT)) == Overlap()


def test_forget_empties_the_worker():
    """A lost stream: nothing is known of the worker until a snapshot."""
    log = KVEventLog(ROOT, PAGE)
    _publish(log, PROMPT, 2)
    index = KVIndex()
    index.apply("w", snapshot_to_proto(log.snapshot()))
    index.forget("w")
    assert index.overlap("w", PromptKeys(PROMPT)) == Overlap() and index.position("w") == ("", 0)
