"""DevicePagePool: a decode rank's page pool in device memory, reachable by other processes of the node
through device IPC (engine/weights/device_ipc.py: CUDA / HIP IPC on a GPU, the memfd stand-in on the CPU).

The pages live in one flat device buffer; beside it a control segment in /dev/shm (a SharedPagePool of
the same layout and page count, named pdserve-kv-dev-*, mapped without populating: its page area stays
unused and costs nothing) holds what host code needs: the owner pid, the layout, the completion slots
prefill and decode exchange per request, and, length-prefixed at the start of its page area, the IPC
handle of the device buffer. Prefill attaches by the control segment's name (the Destination target),
opens the handle and gets a PagedLatentCache over decode's device memory: writes land in place."""
from __future__ import annotations

import logging
import struct
from dataclasses import dataclass

import torch

from engine.weights.device_ipc import DeviceIpc, handle_device, ipc_for
from engine.runtime.devices import rank_device
from engine.cache.kv_cache import CacheShape, PagedLatentCache
from kvtransfer.errors import SegmentError
from kvtransfer.layout import KVLayout
from kvtransfer.shm_pool import SharedPagePool
from kvtransfer.shm_segment import SEGMENT_PREFIX

logger = logging.getLogger(__name__)

DEVICE_PREFIX = SEGMENT_PREFIX + "dev-"  # starts with SEGMENT_PREFIX: the stale-segment cleanup covers it
_LENGTH = struct.Struct("<Q")
_LOCAL: dict[str, DevicePagePool] = {}  # pools this process created: IPC cannot reopen its own memory


def is_device_pool(name: str) -> bool:
    return name.startswith(DEVICE_PREFIX)


class DevicePagePool:
    """A device pool: `cache` over the device buffer, `control` the host segment (slots, handle).
    Exposes the SharedPagePool attributes the shm writer / receiver read (name, layout, num_pages, header,
    completions), so their lease, slot and page checks apply unchanged."""

    def __init__(self, control: SharedPagePool, cache: PagedLatentCache, device_id: str, owner: bool) -> None:
        self.control = control
        self.cache: PagedLatentCache | None = cache
        self.device_id = device_id
        self.is_owner = owner
        self.name, self.layout, self.header = control.name, control.layout, control.header

    @property
    def num_pages(self) -> int:
        return self.control.num_pages

    @property
    def completions(self):
        return self.control.completions

    @classmethod
    def create(cls, layout: KVLayout, num_pages: int, rank: int, tag: str, device: torch.device,
               ipc: DeviceIpc, num_state_slots: int = 0) -> DevicePagePool:
        """num_state_slots: linear-attention state slots after the pages (a layout with state needs them)."""
        buffer = torch.zeros(layout.pool_bytes(num_pages, num_state_slots) // layout.element_size,
                             dtype=layout.torch_dtype, device=device)
        buffer, handle = ipc.share(buffer)
        control = SharedPagePool.create(layout, num_pages, rank, tag, prefix=DEVICE_PREFIX, populate=False,
                                        num_state_slots=num_state_slots)
        assert control.data_view is not None
        if _LENGTH.size + len(handle) > len(control.data_view):
            control.close()
            control.unlink()
            raise SegmentError(f"the IPC handle ({len(handle)} B) does not fit the control segment's page area")
        control.data_view[: _LENGTH.size + len(handle)] = _LENGTH.pack(len(handle)) + handle
        pool = cls(control, PagedLatentCache(layout.to_cache_shape(num_pages, num_state_slots), buffer),
                   ipc.device_id(device), True)
        _LOCAL[pool.name] = pool
        logger.info("device KV pool %s on %s: rank %d, %d pages, %.1f MiB", pool.name, device, rank, num_pages,
                    buffer.numel() * buffer.element_size() / 2**20)
        return pool

    @classmethod
    def attach(cls, name: str, layout: KVLayout, device: torch.device, ipc: DeviceIpc) -> DevicePagePool:
        """Maps pool `name` (LayoutMismatch / SegmentError as SharedPagePool.attach; IpcUnavailable when its
        device memory cannot be opened here)."""
        if not is_device_pool(name):
            raise SegmentError(f"{name!r} is not a device KV pool")
        control = SharedPagePool.attach(name, layout, populate=False)
        assert control.data_view is not None
        (length,) = _LENGTH.unpack(bytes(control.data_view[: _LENGTH.size]))
        handle = bytes(control.data_view[_LENGTH.size : _LENGTH.size + length])
        local = _LOCAL.get(name)
        try:
            buffer = local.cache.buffer if local is not None and local.cache is not None else ipc.open(handle, device)
        except BaseException:
            control.close()
            raise
        cache = PagedLatentCache(layout.to_cache_shape(control.num_pages, control.num_state_slots), buffer.view(-1))
        return cls(control, cache, handle_device(handle), False)

    def owner_alive(self) -> bool:
        return self.control.owner_alive()

    def close(self) -> None:
        """Drops this object's views (the owner's device buffer is freed with its last reference)."""
        self.cache = None
        if self.is_owner:
            _LOCAL.pop(self.name, None)
        self.control.close()

    def unlink(self) -> None:
        self.control.unlink()


@dataclass(frozen=True)
class DevicePoolFactory:
    """engine.cache.page_pool.PagePoolFactory over device pools (picklable): rank r's pool on rank_device(device_type,
    gpus, r); attaches device pools by name and, for any other name, plain shm pools (a prefill engine
    attaches whichever kind the destination names)."""

    device_type: str = "cpu"
    gpus: tuple[int, ...] = ()

    def _device(self, rank: int) -> torch.device:
        gpus = self.gpus or tuple(range(rank + 1))  # no list: rank r on GPU r
        return rank_device(self.device_type, gpus, rank) if self.device_type == "cuda" else torch.device("cpu")

    def create(self, cache_shape: CacheShape, num_pages: int, rank: int, tag: str) -> DevicePagePool:
        device = self._device(rank)
        slots = cache_shape.state.num_slots if cache_shape.state is not None else 0
        return DevicePagePool.create(KVLayout.from_cache_shape(cache_shape), num_pages, rank, tag, device, ipc_for(device),
                                     slots)

    def attach(self, name: str, cache_shape: CacheShape):
        layout = KVLayout.from_cache_shape(cache_shape)
        if not is_device_pool(name):
            return SharedPagePool.attach(name, layout)
        device = current_device(self.device_type)
        return DevicePagePool.attach(name, layout, device, ipc_for(device))


def current_device(device_type: str) -> torch.device:
    """This process's device of a type: the current CUDA device (ModelRunner sets it per rank), or the CPU."""
    if device_type == "cuda" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
