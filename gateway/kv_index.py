"""The gateway's index of what each worker's prefix cache holds, fed by the workers' KV events
(WatchKVEvents, gateway/kv_watch.py), and the overlap of a prompt with it (pure: no I/O).

Per worker: the cache instance and the last event applied, the root key and page size the keys chain from, the
page keys held and the keys of pages with a state checkpoint. A snapshot replaces all of it; events must follow the
last one applied, of the same instance: anything else (a gap, another instance without a snapshot) empties the
worker's entry and asks the watcher to subscribe again from nothing (a snapshot comes first). A lost stream empties
the entry too (forget), so a dead or restarted worker never keeps entries it no longer has.

A prompt's page keys are the engine's (engine/cache/page_keys.py, torch-free), computed once per (root, page
size) per prompt (PromptKeys). Overlap with a worker: the leading pages of the prompt it holds, up to all but the
prompt's last token (what an engine lookup may map): all of them count for decode-side reuse; for a model with
linear-attention layers (needs_checkpoints) a prefill-side hit is usable only up to the last of those pages that
has a checkpoint (Overlap.lookup_tokens)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from engine.cache.page_keys import page_keys
from rpc.internal.v1 import worker_pb2


@dataclass
class WorkerCache:
    """What one worker's prefix cache holds, as its events add up."""

    instance_id: str = ""
    sequence: int = 0
    root: bytes = b""
    page_size: int = 0
    needs_checkpoints: bool = False
    pages: set[bytes] = field(default_factory=set)
    checkpoints: set[bytes] = field(default_factory=set)

    def load(self, instance_id: str, snapshot: worker_pb2.KVSnapshot) -> None:
        self.instance_id, self.sequence = instance_id, snapshot.sequence
        self.root, self.page_size, self.needs_checkpoints = snapshot.root_key, snapshot.page_size, snapshot.needs_checkpoints
        self.pages = {page.key for page in snapshot.pages}
        self.checkpoints = set(snapshot.checkpoint_keys)

    def apply(self, event: worker_pb2.KVEvent) -> None:
        kind = event.WhichOneof("kind")
        if kind == "stored":
            self.pages.add(event.stored.key)
        elif kind == "removed":
            self.pages.discard(event.removed)
            self.checkpoints.discard(event.removed)
        elif kind == "checkpoint_stored":
            self.checkpoints.add(event.checkpoint_stored)
        elif kind == "checkpoint_removed":
            self.checkpoints.discard(event.checkpoint_removed)
        elif kind == "cleared":
            self.root, self.page_size = event.cleared.root_key, event.cleared.page_size
            self.needs_checkpoints = event.cleared.needs_checkpoints
            self.pages, self.checkpoints = set(), set()
        self.sequence = event.sequence


class Overlap(NamedTuple):
    """A prompt against one worker's cache. page_tokens: tokens of the leading pages held (what decode-side reuse
    keeps: the KDA state travels whole from prefill anyway); lookup_tokens: what an engine lookup there maps
    (page_tokens, or for a model with checkpoints up to the last checkpointed page: prefill-side reuse)."""

    page_tokens: int = 0
    lookup_tokens: int = 0


class PromptKeys:
    """One prompt's page keys, computed at most once per (root, page size)."""

    def __init__(self, token_ids: Sequence[int]) -> None:
        self.token_ids = token_ids
        self._keys: dict[tuple[bytes, int], list[bytes]] = {}

    def keys(self, root: bytes, page_size: int) -> list[bytes]:
        """Keys of the full pages an engine lookup may map: those inside all but the prompt's last token."""
        found = self._keys.get((root, page_size))
        if found is None:
            found = self._keys[(root, page_size)] = page_keys(root, self.token_ids, page_size,
                                                              max_tokens=len(self.token_ids) - 1)
        return found


class KVIndex:
    """Worker address -> WorkerCache. apply() returns False when the watcher must subscribe again from nothing."""

    def __init__(self) -> None:
        self._workers: dict[str, WorkerCache] = {}

    def apply(self, address: str, batch: worker_pb2.WatchKVEventsResponse) -> bool:
        cache = self._workers.get(address)
        if batch.HasField("snapshot"):
            cache = self._workers.setdefault(address, WorkerCache())
            cache.load(batch.instance_id, batch.snapshot)
        elif cache is None or batch.instance_id != cache.instance_id:
            self.forget(address)
            return False
        for event in batch.events:
            if event.sequence != cache.sequence + 1:
                self.forget(address)
                return False
            cache.apply(event)
        return True

    def forget(self, address: str) -> None:
        """The worker's stream was lost (or out of order): nothing is known of it until a snapshot."""
        self._workers.pop(address, None)

    def position(self, address: str) -> tuple[str, int]:
        """(instance id, last sequence number applied) to resume from; ("", 0) when nothing is known."""
        cache = self._workers.get(address)
        return (cache.instance_id, cache.sequence) if cache is not None else ("", 0)

    def cache_of(self, address: str) -> WorkerCache | None:
        return self._workers.get(address)

    def overlap(self, address: str, prompt: PromptKeys) -> Overlap:
        """How much of the prompt the worker's cache could serve (Overlap() when nothing is known)."""
        cache = self._workers.get(address)
        if cache is None or cache.page_size <= 0 or not cache.pages:
            return Overlap()
        pages = 0
        usable = 0
        for index, key in enumerate(prompt.keys(cache.root, cache.page_size)):
            if key not in cache.pages:
                break
            pages = index + 1
            if not cache.needs_checkpoints or key in cache.checkpoints:
                usable = pages
        return Overlap(pages * cache.page_size, usable * cache.page_size)
