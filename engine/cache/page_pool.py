"""What the engine needs from whoever owns shared KV pages: a factory that creates this rank's pool or
attaches another process's pool. The engine never imports a transport; the workers hand it one
(kvtransfer.shm_pool.ShmPoolFactory today, a device pool later). Must be picklable: TP followers get it."""
from __future__ import annotations

from typing import Protocol

from engine.cache.kv_cache import CacheShape, PagedLatentCache


class PagePool(Protocol):
    """A page pool whose pages other processes can reach by `name`; `cache` views its tensors."""

    name: str
    cache: PagedLatentCache

    def owner_alive(self) -> bool:
        """False once the process that created the pool is gone (an attached pool of a dead worker: close it,
        or its memory stays mapped here)."""
        ...

    def close(self) -> None: ...


class PagePoolFactory(Protocol):
    def create(self, cache_shape: CacheShape, num_pages: int, rank: int, tag: str) -> PagePool:
        """A new pool of num_pages pages of cache_shape for TP rank `rank` (tag: owner, for names / logs)."""
        ...

    def attach(self, name: str, cache_shape: CacheShape) -> PagePool:
        """Maps the existing pool `name`; raises (ValueError family) if its geometry is not cache_shape's."""
        ...
