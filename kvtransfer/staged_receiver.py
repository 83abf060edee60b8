"""gRPC pushes into a device pool (another node's prefill, or a GPU prefill with `--transport grpc`): the
chunks land in a host mirror of each rank's page area, exactly as PushReceiver writes an shm pool, and
admit() copies the request's pages to the device pools (one host-to-device copy per run of consecutive
pages and layer, then a device sync) before the request is handed to the engine.

The mirror is an anonymous MAP_NORESERVE mapping of the pool's size: its pages cost memory only once a push
writes them (a node that receives no gRPC pushes pays nothing), and reserving it never trips the kernel's
overcommit check however large the device pools are."""
from __future__ import annotations

import mmap
import warnings
from collections.abc import Sequence

import torch

from engine.cache.kv_cache import PagedLatentCache
from kvtransfer.grpc_receiver import PushReceiver
from kvtransfer.page_spans import page_runs
from kvtransfer.transport import TransferResult


_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)  # Linux's value; the mmap module names it from 3.13


def host_mirror(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """numel elements of lazily committed host memory (see the module docstring)."""
    nbytes = max(numel * torch.empty(0, dtype=dtype).element_size(), 1)
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.frombuffer(mapping, dtype=dtype, count=numel)


def copy_pages(source: PagedLatentCache, target: PagedLatentCache, page_ids: Sequence[int]) -> None:
    """Copies pages page_ids of every target and draft layer from source to target (same geometry)."""
    for _index, first, count in page_runs(sorted(page_ids)):
        target.kv[:, first : first + count].copy_(source.kv[:, first : first + count], non_blocking=True)
        if target.draft is not None and source.draft is not None:
            target.draft[:, first : first + count].copy_(source.draft[:, first : first + count], non_blocking=True)
    if target.buffer.is_cuda:
        torch.cuda.synchronize(target.buffer.device)


class StagedPushReceiver(PushReceiver):
    """PushReceiver over host mirrors of device caches (caches[r]: decode rank r's device pool cache)."""

    def __init__(self, caches: Sequence[PagedLatentCache], addresses: Sequence[str] = (), **options) -> None:
        mirrors = [PagedLatentCache(cache.shape, host_mirror(cache.buffer.numel(), cache.shape.dtype)) for cache in caches]
        super().__init__(mirrors, addresses, **options)
        self._pairs = list(zip(mirrors, caches))

    def admit_now(self, request_id: str, max_verify_bytes: int) -> TransferResult | None:
        return None  # admission copies the pages from the host mirrors to the device: never on the event loop

    def admit(self, request_id: str, timeout_s: float = 0.0) -> TransferResult:
        with self._lock:
            request = self._requests.get(request_id)
        page_ids = request.destination.page_ids if request is not None else ()
        result = super().admit(request_id, timeout_s)
        for mirror, cache in self._pairs:
            copy_pages(mirror, cache, page_ids)
        return result
