"""GPU variant of the same-host path: decode exports its device page pool through CUDA / HIP IPC handles,
prefill on the same device opens them and runs its forward straight into the reserved pages.

Design (docs/kvtransfer.md, "GPU IPC"): the decode rank allocates its pool as one flat device tensor
and calls export_pool(); the handle (torch's CUDA-IPC reduction of the tensor: cudaIpcGetMemHandle /
hipIpcGetMemHandle of the allocation, plus offset, size and dtype) travels to prefill rank r once, at
start-up. Prefill calls open_pool() and gets a PagedLatentCache over the same device memory (no copy).
Per request the host-side shm pool's completion slot table is still used (created with a tiny page
area): prefill synchronises its stream after the last layer, then writes the completion record; decode
reads it before admitting the request. This code path needs a GPU; without one every entry point raises
TransportUnavailable.
"""
from __future__ import annotations

import io
import pickle
from dataclasses import dataclass

import torch

from engine.kv_cache import PagedLatentCache
from kvtransfer.errors import TransportUnavailable
from kvtransfer.layout import KVLayout, check_layout

_ALLOWED_MODULES = ("torch", "torch.storage", "torch._utils", "torch.multiprocessing.reductions", "collections")


def require_gpu() -> None:
    if not torch.cuda.is_available():
        raise TransportUnavailable("GPU IPC needs a CUDA or ROCm device, and this process sees none")


@dataclass(frozen=True)
class PoolHandle:
    """What decode sends prefill (same host, same device) to open its device pool."""

    payload: bytes  # pickled (rebuild function, args) from torch.multiprocessing.reductions.reduce_tensor
    layout_hash: str
    num_pages: int
    device_uuid: str


def _device_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def export_pool(buffer: torch.Tensor, layout: KVLayout, num_pages: int) -> PoolHandle:
    """Decode side: an IPC handle for the pool's flat device buffer. Keep `buffer` alive while prefill uses it."""
    require_gpu()
    if not buffer.is_cuda or buffer.dim() != 1 or buffer.dtype != layout.torch_dtype:
        raise ValueError("export_pool needs the pool's flat 1-D device buffer of the layout's dtype")
    if buffer.numel() < layout.pool_bytes(num_pages) // layout.element_size:
        raise ValueError("buffer is smaller than the pool")
    from torch.multiprocessing.reductions import reduce_tensor

    rebuild, args = reduce_tensor(buffer)
    return PoolHandle(pickle.dumps((rebuild, args)), layout.hash, num_pages, _device_uuid(buffer.device))


class _TorchOnlyUnpickler(pickle.Unpickler):
    """The handle only ever holds torch objects; refuse anything else."""

    def find_class(self, module: str, name: str):
        if module in _ALLOWED_MODULES or module.startswith("torch."):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"unexpected {module}.{name} in a pool handle")


def open_pool(handle: PoolHandle, expected_layout: KVLayout) -> PagedLatentCache:
    """Prefill side: maps decode's device pool (same physical device required) as a PagedLatentCache."""
    require_gpu()
    check_layout(expected_layout, handle.layout_hash, "GPU pool handle")
    rebuild, args = _TorchOnlyUnpickler(io.BytesIO(handle.payload)).load()
    buffer = rebuild(*args)
    if _device_uuid(buffer.device) != handle.device_uuid:
        raise TransportUnavailable("the pool lives on another device; use the grpc or mooncake transport")
    return PagedLatentCache(expected_layout.to_cache_shape(handle.num_pages), buffer)


def finish_in_place() -> None:
    """Call after the last kernel that writes the request's pages, before writing its completion record."""
    require_gpu()
    torch.cuda.current_stream().synchronize()
