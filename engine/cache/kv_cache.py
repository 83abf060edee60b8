"""Paged latent KV cache: page storage, a reference-counted page allocator, per-sequence page tables."""
from __future__ import annotations

import heapq
import threading
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.model_configs.base import check_positive
from engine.cache.state_pool import SLOT_ALIGN, StatePool, StateShape


@dataclass(frozen=True)
class CacheShape:
    """Geometry of one TP rank's page pool (identical on every rank: the MLA latent is not sharded).

    target pages: [num_layers, num_pages, page_size, latent_dim + rope_dim]
    draft pages:  [draft_layers, num_pages, page_size, draft_dim] (the draft model's context K/V,
                  sharing page ids with the target; draft_layers == 0 when there is no draft)
    state:        models with linear attention: this rank's state slots (engine/cache/state_pool.py), kept in
                  the same flat buffer after the pages, from byte state_offset on (None: no state)
    """

    num_layers: int
    num_pages: int
    page_size: int
    latent_dim: int
    rope_dim: int
    dtype: torch.dtype
    draft_layers: int = 0
    draft_dim: int = 0
    state: StateShape | None = None

    def __post_init__(self) -> None:
        check_positive(self, ("num_layers", "num_pages", "page_size", "latent_dim"), "CacheShape.")
        if self.rope_dim < 0 or self.draft_layers < 0 or self.draft_dim < 0:
            raise ValueError("CacheShape dims must be non-negative")

    @property
    def state_offset(self) -> int:
        """Byte offset of the state slots in the flat buffer: after the pages, aligned to SLOT_ALIGN."""
        size = self.dtype.itemsize
        return -(-(self.target_numel + self.draft_numel) * size // SLOT_ALIGN) * SLOT_ALIGN

    @property
    def buffer_bytes(self) -> int:
        """Bytes of the whole flat buffer: pages, then (with state) the padding and the state slots."""
        if self.state is None:
            return (self.target_numel + self.draft_numel) * self.dtype.itemsize
        return self.state_offset + self.state.pool_bytes

    @property
    def entry_dim(self) -> int:
        return self.latent_dim + self.rope_dim

    @property
    def bytes_per_page(self) -> int:
        size = torch.tensor([], dtype=self.dtype).element_size()
        return self.page_size * size * (self.num_layers * self.entry_dim + self.draft_layers * self.draft_dim)

    @property
    def target_numel(self) -> int:
        return self.num_layers * self.num_pages * self.page_size * self.entry_dim

    @property
    def draft_numel(self) -> int:
        return self.draft_layers * self.num_pages * self.page_size * self.draft_dim


class PagedLatentCache:
    """Views over one flat buffer (local memory or a shared-memory segment): target then draft pages.

    state: the per-sequence state pool of the model's linear-attention layers (None for pure-MLA models).
    """

    def __init__(
        self, shape: CacheShape, buffer: torch.Tensor | None = None, state: StatePool | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        total = shape.target_numel + shape.draft_numel
        size = shape.dtype.itemsize
        numel = -(-shape.buffer_bytes // size)
        if buffer is None:
            buffer = torch.zeros(numel, dtype=shape.dtype, device=device)
        if buffer.numel() < numel or buffer.dtype != shape.dtype:
            raise ValueError(f"cache buffer of {buffer.numel()} {buffer.dtype} cannot hold {numel} {shape.dtype}")
        self.shape = shape
        self.buffer = buffer
        if state is None and shape.state is not None:  # the state slots live in the buffer, after the pages
            raw = buffer[:numel].view(torch.uint8)[shape.state_offset : shape.buffer_bytes]
            state = StatePool(shape.state, raw=raw.view(shape.state.num_slots, shape.state.slot_stride))
        self.state = state
        self.kv = buffer[: shape.target_numel].view(shape.num_layers, shape.num_pages, shape.page_size, shape.entry_dim)
        if shape.draft_layers:
            self.draft = buffer[shape.target_numel : total].view(
                shape.draft_layers, shape.num_pages, shape.page_size, shape.draft_dim
            )
        else:
            self.draft = None

    def layer(self, index: int) -> torch.Tensor:
        """[num_pages, page_size, entry_dim] of one target layer."""
        return self.kv[index]

    def draft_layer(self, index: int) -> torch.Tensor:
        """[num_pages, page_size, draft_dim] of one draft layer."""
        if self.draft is None:
            raise ValueError("this cache has no draft context pages")
        return self.draft[index]


class OutOfPages(RuntimeError):
    """The pool has fewer free pages than a request needs (rpc.status reports the grpc_status name)."""

    grpc_status = "RESOURCE_EXHAUSTED"


class EvictablePages(Protocol):
    """What the allocator asks of a prefix cache (engine/cache/prefix_cache.py): pages it holds stay out of the
    free list while unreferenced (counted as free: num_evictable) until evict() gives one back."""

    num_evictable: int

    def holds(self, page: int) -> bool: ...

    def released(self, page: int) -> None: ...

    def acquired(self, page: int) -> None: ...

    def evict(self) -> int | None: ...


class PageAllocator:
    """Reference-counted page ids 0..num_pages-1. Freed pages are reused lowest-first.

    Thread-safe: every change happens under `lock` (reentrant), so a decode worker's event loop can
    reserve pages while the engine thread runs a step. Whoever decides from num_free and then allocates
    (the scheduler, the decode worker's admission) holds `lock` across both. lock: shared with the
    engine's state pool, so one lock covers every reservation (None: a lock of its own).

    With a prefix cache attached (`cache`), a page the cache holds does not return to the free list when its
    last reference goes: it stays cached, counts as free, and is evicted (least recently used, leaves first)
    when an allocation needs it; incref brings a cached unreferenced page back into use."""

    def __init__(self, num_pages: int, lock: threading.RLock | None = None) -> None:
        if num_pages <= 0:
            raise ValueError("num_pages must be positive")
        self.num_pages = num_pages
        self.lock = lock if lock is not None else threading.RLock()
        self._refs = [0] * num_pages
        self._free = list(range(num_pages))  # a min-heap: the lowest free id is reused first
        self.cache: EvictablePages | None = None

    @property
    def num_free(self) -> int:
        """Pages an allocation can get now: the free list plus the cache's unreferenced pages."""
        return len(self._free) + (self.cache.num_evictable if self.cache is not None else 0)

    @property
    def num_uncached_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count < 0:
            raise ValueError("count must be non-negative")
        with self.lock:
            if count > self.num_free:
                raise OutOfPages(f"need {count} pages, {self.num_free} free of {self.num_pages}")
            while len(self._free) < count:
                page = self.cache.evict() if self.cache is not None else None
                if page is None:
                    raise OutOfPages(f"need {count} pages, {len(self._free)} free of {self.num_pages} "
                                     "(the cache could evict no more)")
                heapq.heappush(self._free, page)
            pages = [heapq.heappop(self._free) for _ in range(count)]
            for page in pages:
                self._refs[page] = 1
        return pages

    def incref(self, pages: list[int]) -> None:
        """One more reference to each page: allocated ones, or cached unreferenced ones (taken back into use)."""
        with self.lock:
            for page in pages:
                if self._refs[page] <= 0 and (self.cache is None or not self.cache.holds(page)):
                    raise ValueError(f"page {page} is not allocated")
            for page in pages:
                if self._refs[page] == 0:
                    self.cache.acquired(page)
                self._refs[page] += 1

    def free(self, pages: list[int]) -> None:
        """Drops one reference from each page; a page with none left returns to the pool (or, held by the
        prefix cache, stays cached and evictable)."""
        with self.lock:
            for page in pages:
                if not 0 <= page < self.num_pages or self._refs[page] <= 0:
                    raise ValueError(f"page {page} is not allocated")
                self._refs[page] -= 1
                if self._refs[page] == 0:
                    if self.cache is not None and self.cache.holds(page):
                        self.cache.released(page)
                    else:
                        heapq.heappush(self._free, page)

    def refcount(self, page: int) -> int:
        return self._refs[page]


class PageTable:
    """The pages of one sequence, grown as it lengthens and shrunk after rejected drafts."""

    def __init__(self, allocator: PageAllocator, page_size: int, pages: list[int] | None = None) -> None:
        self.allocator = allocator
        self.page_size = page_size
        self.pages: list[int] = list(pages or [])
        self.cache_keys: list[bytes] = []  # prefix cache keys of pages[:len(cache_keys)] (engine/cache/prefix_cache.py)
        self.publishing = True  # False once a page turned out to duplicate another cached one: publish no further

    @property
    def capacity(self) -> int:
        return len(self.pages) * self.page_size

    def pages_needed(self, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.page_size) - len(self.pages))

    def ensure(self, num_tokens: int) -> None:
        """Allocates pages so that num_tokens positions fit (raises OutOfPages, allocating nothing)."""
        need = self.pages_needed(num_tokens)
        if need:
            self.pages.extend(self.allocator.allocate(need))

    def truncate(self, num_tokens: int) -> None:
        """Frees pages wholly beyond num_tokens positions."""
        keep = -(-num_tokens // self.page_size)
        if keep < len(self.pages):
            extra = self.pages[keep:]
            del self.pages[keep:]
            del self.cache_keys[keep:]
            self.allocator.free(extra)

    def release(self) -> None:
        self.cache_keys, self.publishing = [], True
        if self.pages:
            pages, self.pages = self.pages, []
            self.allocator.free(pages)
