"""Prefix cache: full KV pages reused across requests, and (models with KDA layers) state checkpoints.

Keys: a page holding tokens t[i*P : (i+1)*P] is published under key_i = H(key_{i-1} | t[...]) with key_-1 =
H(salt) (salt: model, dtype, draft; engine/runtime/llm_engine.py), H = blake2b-128. A node also keeps its tokens, and a
lookup compares them, so a hash collision can never map a wrong page.

Invariants (checked by tests/engine/test_prefix_cache_refcounts.py):
- only full pages are published, and a published page is never written again (a sequence only writes
  positions >= its num_cached, and publishes pages < num_cached // P), so sharing needs no copy on write;
- a node's children (cached nodes keyed from it) live on pages whose holders also hold the node's page: a
  sequence publishes page i only if its page i-1 is the cached node of key_{i-1} (a sequence that computed a
  duplicate of a cached page publishes nothing further). So an unreferenced node has only unreferenced
  descendants, and every unreferenced node can be evicted, leaves first: num_evictable counts them all;
- the page allocator (engine/cache/kv_cache.py) keeps reference counts; a cached page whose count drops to 0 stays
  here (counted as free) until evict() hands it back, least recently used leaf first.

KDA state: a hit on a model with linear-attention layers is usable only up to the last matched page whose node
holds a state checkpoint (the state of every KDA layer after that page's last token), kept in a pool of its own
(CheckpointSlots; the device buffers live on each rank: engine/runtime/model_runner.py). Checkpoints are evicted least
recently used under that pool's size; a node whose checkpoint went keeps its page (a "tombstone" for the state,
still the prefix of longer checkpointed hits). A checkpoint a waiting sequence will restore is pinned.

Branch points (KDA models): when the matched run of pages goes past its last checkpoint, the lookup also hands out
the pages after it (the "branch": referenced, not mapped). The sequence recomputes those positions into pages of its
own, its chunk ends exactly at the branch's end, and there (engine/cache/prefix_reuse.py) it swaps its duplicate
pages for the cached ones and saves a checkpoint on the branch's last node: the first request that shares a prefix
with an earlier one recomputes back to a checkpoint once, every later one sharing it hits it whole."""
from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple

from engine.runtime.outputs import PrefixCacheStats
from engine.cache.kv_cache import PageAllocator, PageTable
from engine.cache.kv_events import CheckpointRemoved, CheckpointStored, KVEvent, KVEventLog, PageRemoved, PageStored
from engine.cache.page_keys import chain_key, root_key


@dataclass(eq=False)
class CachedPage:
    key: bytes
    parent: bytes
    page: int
    tokens: tuple[int, ...]
    has_draft: bool  # the draft model's context entries of these positions are in the page too
    children: int = 0
    last_used: int = 0
    checkpoint: int | None = None  # checkpoint slot: KDA state after this page's last token


class PrefixHit(NamedTuple):
    """What a lookup mapped: pages (one reference each now held by the caller), their keys, and for KDA models
    the checkpoint slot (pinned) holding the state at the end of the last page, and the branch: the matched
    pages after that checkpoint (referenced too, to be swapped in once the sequence has recomputed their state)
    and their keys."""

    pages: list[int]
    keys: list[bytes]
    checkpoint: int | None
    branch_pages: tuple[int, ...] = ()
    branch_keys: tuple[bytes, ...] = ()
    checkpoint_pages: int = 0  # the checkpoint holds the state after pages[:checkpoint_pages] (past_checkpoint)


class CheckpointSlots:
    """Bookkeeping of the checkpoint pool: free slots, least recently used order, pins."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots))
        self._lru: OrderedDict[int, CachedPage] = OrderedDict()  # slot -> node, oldest first
        self._pins: dict[int, int] = {}

    @property
    def num_used(self) -> int:
        return len(self._lru)

    def touch(self, slot: int) -> None:
        self._lru.move_to_end(slot)

    def pin(self, slot: int) -> None:
        self._pins[slot] = self._pins.get(slot, 0) + 1

    def unpin(self, slot: int) -> None:
        count = self._pins[slot] - 1
        if count:
            self._pins[slot] = count
        else:
            del self._pins[slot]

    def pinned(self, slot: int) -> bool:
        return slot in self._pins

    def take(self, node: CachedPage) -> tuple[int | None, CachedPage | None]:
        """A slot for node's checkpoint: a free one, or the least recently used unpinned one (returned with the
        node it is taken from). (None, None) when every slot is pinned."""
        victim = None
        if self._free:
            slot = heapq.heappop(self._free)
        else:
            slot = next((s for s in self._lru if s not in self._pins), None)
            if slot is None:
                return None, None
            victim = self._lru.pop(slot)
            victim.checkpoint = None
        self._lru[slot] = node
        node.checkpoint = slot
        return slot, victim

    def release(self, node: CachedPage) -> None:
        slot = node.checkpoint
        if slot is None:
            return
        node.checkpoint = None
        self._lru.pop(slot, None)
        self._pins.pop(slot, None)
        heapq.heappush(self._free, slot)


class PrefixCache:
    """The page cache of one engine. All methods run under the allocator's lock (the scheduler's decision,
    a decode worker's reservation and the engine's publishing share it). kv_events: record what enters and leaves
    in `events` (engine/cache/kv_events.py: page stored / removed, checkpoint stored / removed) for routers."""

    def __init__(self, allocator: PageAllocator, page_size: int, salt: str, num_checkpoints: int = 0,
                 needs_checkpoints: bool = False, checkpoint_interval: int = 0, kv_events: bool = True) -> None:
        self.allocator = allocator
        self.page_size = page_size
        self.root = root_key(salt)
        self.events: KVEventLog | None = KVEventLog(self.root, page_size, needs_checkpoints) if kv_events else None
        self.needs_checkpoints = needs_checkpoints
        self.checkpoint_interval = checkpoint_interval
        self.checkpoints = CheckpointSlots(num_checkpoints) if needs_checkpoints else None
        self._nodes: dict[bytes, CachedPage] = {}
        self._by_page: dict[int, CachedPage] = {}
        self._leaves: list[tuple[int, int]] = []  # heap of (last_used, page): unreferenced leaf candidates
        self._tick = itertools.count(1)
        self.num_evictable = 0
        self.stats = PrefixCacheStats(checkpoint_slots=num_checkpoints if needs_checkpoints else 0)
        allocator.cache = self

    # --- keys -------------------------------------------------------------------------------------------------
    def chain(self, parent: bytes, tokens: list[int] | tuple[int, ...]) -> bytes:
        return chain_key(parent, tokens)

    def _record(self, event: KVEvent) -> None:
        if self.events is not None:
            self.events.record(event)

    # --- the allocator's side (EvictablePages) ----------------------------------------------------------------
    def holds(self, page: int) -> bool:
        return page in self._by_page

    def released(self, page: int) -> None:
        node = self._by_page[page]
        node.last_used = next(self._tick)
        self.num_evictable += 1
        if node.children == 0:
            heapq.heappush(self._leaves, (node.last_used, page))

    def acquired(self, page: int) -> None:
        self._by_page[page].last_used = next(self._tick)
        self.num_evictable -= 1

    def evict(self) -> int | None:
        """Drops the least recently used unreferenced leaf; returns its page (now the allocator's to free)."""
        while self._leaves:
            tick, page = heapq.heappop(self._leaves)
            node = self._by_page.get(page)
            if node is None or node.last_used != tick or node.children or self.allocator.refcount(page):
                continue  # a stale entry: the node was used, gained a child or went since
            self._remove(node)
            return page
        return None

    def _remove(self, node: CachedPage) -> None:
        del self._nodes[node.key]
        del self._by_page[node.page]
        self._record(PageRemoved(node.key))  # (its checkpoint goes with it)
        self.num_evictable -= 1
        self.stats.evicted_pages += 1
        if self.checkpoints is not None and node.checkpoint is not None:
            self.checkpoints.release(node)
            self.stats.evicted_checkpoints += 1
        parent = self._nodes.get(node.parent)
        if parent is not None:
            parent.children -= 1
            if parent.children == 0 and self.allocator.refcount(parent.page) == 0:
                heapq.heappush(self._leaves, (parent.last_used, parent.page))

    # --- lookups ----------------------------------------------------------------------------------------------
    def match(self, token_ids: list[int], max_tokens: int, need_draft: bool, count_query: int,
              branch: bool = False, past_checkpoint: bool = False) -> PrefixHit:
        """Maps the longest cached run of full pages of token_ids[:max_tokens] and takes a reference on each page;
        for KDA models up to the last page with a checkpoint, unless past_checkpoint (a decode worker's
        Reserve, whose handoff brings the state whole: every matched page, checkpoint_pages saying where the
        checkpoint ends); with `branch`, the rest of the run past the checkpoint is the hit's branch, referenced
        too - the caller frees those references or swaps the pages in. count_query: prompt tokens to count as
        queried in the statistics."""
        size = self.page_size
        with self.allocator.lock:
            nodes: list[CachedPage] = []
            key = self.root
            for start in range(0, max_tokens - size + 1, size):
                tokens = token_ids[start : start + size]
                node = self._nodes.get(self.chain(key, tokens))
                if node is None or list(node.tokens) != tokens or (need_draft and not node.has_draft):
                    break
                nodes.append(node)
                key = node.key
            checkpoint, checkpoint_pages, after = None, 0, []
            if self.needs_checkpoints:
                checkpoint_pages = len(nodes)
                while checkpoint_pages and nodes[checkpoint_pages - 1].checkpoint is None:
                    checkpoint_pages -= 1
                if branch and not past_checkpoint:
                    after = nodes[checkpoint_pages:]
                if not past_checkpoint:
                    del nodes[checkpoint_pages:]
                if checkpoint_pages:
                    checkpoint = nodes[checkpoint_pages - 1].checkpoint
                    self.checkpoints.touch(checkpoint)
                    self.checkpoints.pin(checkpoint)
                    self.stats.checkpoint_hits += 1
            pages = [node.page for node in nodes]
            branch_pages = tuple(node.page for node in after)
            self.allocator.incref(pages + list(branch_pages))
            if count_query:  # a first lookup (a recomputed sequence's later ones are not counted)
                self.stats.queried_tokens += count_query
                self.stats.hit_tokens += len(pages) * size
            return PrefixHit(pages, [node.key for node in nodes], checkpoint, branch_pages,
                             tuple(node.key for node in after), checkpoint_pages)

    def keys_of(self, token_ids: list[int], num_pages: int) -> list[bytes]:
        """The chained keys of token_ids' first num_pages full pages (what a hit of that many pages maps)."""
        keys, key, size = [], self.root, self.page_size
        for index in range(num_pages):
            key = self.chain(key, token_ids[index * size : (index + 1) * size])
            keys.append(key)
        return keys

    def unpin(self, checkpoint: int) -> None:
        with self.allocator.lock:
            if self.checkpoints is not None and self.checkpoints.pinned(checkpoint):
                self.checkpoints.unpin(checkpoint)

    # --- publishing -------------------------------------------------------------------------------------------
    def publish(self, table: PageTable, token_ids: list[int], num_cached: int, has_draft: bool) -> None:
        """Publishes the sequence's pages made full by its first num_cached tokens (see the module invariants)."""
        size = self.page_size
        with self.allocator.lock:
            while table.publishing and len(table.cache_keys) < min(num_cached // size, len(table.pages)):
                index = len(table.cache_keys)
                parent = table.cache_keys[-1] if table.cache_keys else self.root
                tokens = tuple(token_ids[index * size : (index + 1) * size])
                key = self.chain(parent, tokens)
                page = table.pages[index]
                node = self._nodes.get(key)
                if node is None:
                    node = CachedPage(key, parent, page, tokens, has_draft, last_used=next(self._tick))
                    self._nodes[key] = node
                    self._by_page[page] = node
                    self._record(PageStored(key, parent, size, has_draft))
                    parent_node = self._nodes.get(parent)
                    if parent_node is not None:
                        parent_node.children += 1
                elif node.page != page:
                    table.publishing = False  # a duplicate computed beside the cached page: publish no further
                    break
                table.cache_keys.append(key)

    def save_checkpoint(self, key: bytes) -> int | None:
        """A checkpoint slot for the state at the end of the cached page `key` (None: it has one already, the
        page is not cached, or every slot is pinned). The caller copies the state into it."""
        with self.allocator.lock:
            node = self._nodes.get(key)
            if self.checkpoints is None or node is None:
                return None
            if node.checkpoint is not None:
                self.checkpoints.touch(node.checkpoint)
                return None
            slot, victim = self.checkpoints.take(node)
            if victim is not None:
                self.stats.evicted_checkpoints += 1
                self._record(CheckpointRemoved(victim.key))
            if slot is not None:
                self._record(CheckpointStored(key))
            return slot

    def drop_checkpoint(self, key: bytes) -> None:
        with self.allocator.lock:
            node = self._nodes.get(key)
            if node is not None and node.checkpoint is not None and not self.checkpoints.pinned(node.checkpoint):
                self.checkpoints.release(node)
                self._record(CheckpointRemoved(key))

    def is_checkpoint_position(self, position: int, target: int) -> bool:
        """Prefill checkpoints: every checkpoint_interval tokens, and the last page boundary of the prompt."""
        size = self.page_size
        return position > 0 and position % size == 0 and (
            position % self.checkpoint_interval == 0 or position == target // size * size)

    def chunk_end(self, num_cached: int, target: int) -> int:
        """Where a prefill chunk starting at num_cached must stop so that it ends on the next checkpoint position."""
        interval = (num_cached // self.checkpoint_interval + 1) * self.checkpoint_interval
        last_page = target // self.page_size * self.page_size
        return min(interval, last_page) if last_page > num_cached else min(interval, target)

    # --- inspection -------------------------------------------------------------------------------------------
    def snapshot(self) -> PrefixCacheStats:
        with self.allocator.lock:
            stats = self.stats
            return PrefixCacheStats(
                stats.queried_tokens, stats.hit_tokens, stats.checkpoint_hits, len(self._nodes), self.num_evictable,
                stats.evicted_pages, self.checkpoints.num_used if self.checkpoints is not None else 0,
                stats.checkpoint_slots, stats.evicted_checkpoints)

    def check_consistency(self) -> None:
        """Raises AssertionError when a bookkeeping invariant is broken (tests)."""
        with self.allocator.lock:
            unreferenced = 0
            for page, node in self._by_page.items():
                assert self._nodes[node.key] is node and node.page == page
                children = sum(1 for other in self._nodes.values() if other.parent == node.key)
                assert children == node.children, f"page {page}: {node.children} children counted, {children} held"
                refs = self.allocator.refcount(page)
                if refs == 0:
                    unreferenced += 1
                    assert page not in self.allocator._free, f"cached page {page} is also on the free list"
                parent = self._nodes.get(node.parent)
                if parent is not None and refs:
                    assert self.allocator.refcount(parent.page), f"page {page} is in use but its parent is not"
            assert unreferenced == self.num_evictable, f"{unreferenced} unreferenced, {self.num_evictable} counted"
            if self.checkpoints is not None:
                held = {node.checkpoint for node in self._nodes.values() if node.checkpoint is not None}
                assert held == set(self.checkpoints._lru), "checkpoint slots and nodes disagree"
                assert not held & set(self.checkpoints._free)
                assert len(held) + len(self.checkpoints._free) == self.checkpoints.num_slots
            if self.events is not None:  # the KV events add up to what is held
                snapshot = self.events.snapshot()
                assert {page.key: page.parent for page in snapshot.pages} == {
                    key: node.parent for key, node in self._nodes.items()}, "KV events and cached pages disagree"
                assert set(snapshot.checkpoints) == {node.key for node in self._nodes.values()
                                                     if node.checkpoint is not None}, "KV events and checkpoints disagree"
