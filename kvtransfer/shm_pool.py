"""SharedPagePool: one TP rank's decode page pool in a POSIX shared-memory segment (/dev/shm, Linux).

Segment: [header 4 KiB | completion slots | pad to 64 KiB | page data (the PagedLatentCache buffer)].
The decode worker creates (owns) it; the prefill worker attaches by name and writes pages in place. The
name is unguessable (secrets.token_hex), the file mode 0600 and its owner our uid. The header records the
owner's pid (and its start time, against pid reuse) so cleanup_stale_segments() can remove the segments of
a killed owner at the next start. os.open + mmap is used directly: multiprocessing.shared_memory's
resource tracker would unlink (or warn about) segments that other processes attached.
"""
from __future__ import annotations

import atexit
import logging
import mmap
import os
import secrets
import stat
from dataclasses import dataclass

import torch

from engine.cache.kv_cache import CacheShape, PagedLatentCache
from kvtransfer.completion import SLOT_BYTES, CompletionTable
from kvtransfer.errors import LayoutMismatch, SegmentError
from kvtransfer.layout import KVLayout
from kvtransfer.shm_segment import (
    HEADER, HEADER_BYTES, SEGMENT_PREFIX, SHM_DIR, PoolHeader, cleanup_stale_segments, unlink_segment,
)
from rpc.processes import start_ticks

__all__ = ["SharedPagePool", "cleanup_stale_segments", "PoolHeader", "SEGMENT_PREFIX", "SHM_DIR"]
logger = logging.getLogger(__name__)

DATA_ALIGN = 64 * 1024
MAX_SLOTS = 4096
_OWNED: dict[str, int] = {}  # segment name -> pid of the process that created it


class SharedPagePool:
    """A mapped pool segment. Build with create() (decode, owner) or attach() (prefill)."""

    def __init__(self, name: str, mapping: mmap.mmap, header: PoolHeader, layout: KVLayout, owner: bool) -> None:
        self.name = name
        self.layout = layout
        self.header = header
        self.num_pages, self.num_state_slots = header.num_pages, header.num_state_slots
        self.is_owner = owner
        self._mm = mapping
        whole = memoryview(mapping)
        self.data_view: memoryview | None = whole[header.data_offset : header.data_offset + header.data_bytes]
        self.completions = CompletionTable(whole[HEADER_BYTES : HEADER_BYTES + header.num_slots * SLOT_BYTES], header.num_slots)
        numel = header.data_bytes // layout.element_size
        self.tensor: torch.Tensor | None = torch.frombuffer(mapping, dtype=layout.torch_dtype, count=numel, offset=header.data_offset)
        shape = layout.to_cache_shape(header.num_pages, header.num_state_slots)
        self.cache: PagedLatentCache | None = PagedLatentCache(shape, self.tensor)  # (its state slots: in the segment too)
        self._closed = False

    # --- construction -------------------------------------------------------------------------------
    @classmethod
    def create(
        cls, layout: KVLayout, num_pages: int, rank: int = 0, owner_tag: str = "", *,
        num_slots: int | None = None, prefix: str = SEGMENT_PREFIX, populate: bool = True, num_state_slots: int = 0,
    ) -> SharedPagePool:
        """num_slots: completion record slots; num_state_slots: linear-attention state slots (a layout with
        state needs at least one), kept after the pages."""
        if num_pages <= 0:
            raise ValueError("num_pages must be positive")
        if layout.has_state != (num_state_slots > 0):
            raise ValueError(f"num_state_slots={num_state_slots} does not fit a layout "
                             f"{'with' if layout.has_state else 'without'} linear-attention state")
        slots = num_slots if num_slots is not None else min(num_pages, MAX_SLOTS)
        if not 0 < slots <= MAX_SLOTS:
            raise ValueError(f"num_slots must be in 1..{MAX_SLOTS}")
        data_offset = -(-(HEADER_BYTES + slots * SLOT_BYTES) // DATA_ALIGN) * DATA_ALIGN
        data_bytes = layout.pool_bytes(num_pages, num_state_slots)
        name = f"{prefix}{secrets.token_hex(16)}"
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.fchmod(fd, 0o600)  # the umask can only remove bits; make the mode exact anyway
            os.ftruncate(fd, data_offset + data_bytes)
            _OWNED[name] = os.getpid()
            mapping = _map(fd, data_offset + data_bytes, populate)
        except BaseException:
            os.close(fd)
            _unlink(name)
            raise
        os.close(fd)
        pid = os.getpid()
        header = PoolHeader(
            pid, start_ticks(pid) or 0, num_pages, data_offset, data_bytes, slots, rank, layout.hash,
            owner_tag, layout.canonical, num_state_slots,
        )
        mapping[: HEADER.size] = header.pack()
        logger.info("created KV pool %s: rank %d, %d pages, %.1f MiB", name, rank, num_pages, data_bytes / 2**20)
        return cls(name, mapping, header, layout, owner=True)

    @classmethod
    def attach(cls, name: str, expected_layout: KVLayout, *, populate: bool = True) -> SharedPagePool:
        """Maps an existing pool read/write; LayoutMismatch if its layout hash is not expected_layout's."""
        if "/" in name or not name:
            raise SegmentError(f"bad shm segment name {name!r}")
        try:
            fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_NOFOLLOW)
        except FileNotFoundError as error:
            raise SegmentError(f"shm segment {name} does not exist") from error
        try:
            info = os.fstat(fd)
            if info.st_uid != os.getuid() or stat.S_IMODE(info.st_mode) & 0o077:
                raise SegmentError(f"shm segment {name} is not private to this user (uid / mode)")
            header = PoolHeader.unpack(os.pread(fd, HEADER.size, 0), name)
            if header.layout_hash != expected_layout.hash:
                raise LayoutMismatch(
                    f"KV layout mismatch attaching {name}: pool has {header.layout_hash} ({header.layout_canonical}),"
                    f" expected {expected_layout.hash} ({expected_layout.canonical})"
                )
            if info.st_size < header.data_offset + header.data_bytes:
                raise SegmentError(f"shm segment {name} is shorter than its header says")
            mapping = _map(fd, header.data_offset + header.data_bytes, populate)
        finally:
            os.close(fd)
        return cls(name, mapping, header, expected_layout, owner=False)

    # --- properties ---------------------------------------------------------------------------------

    @property
    def mapping_bytes(self) -> int:
        """Size of the whole segment (header, slots, pages)."""
        return self.header.data_offset + self.header.data_bytes

    @property
    def data_address(self) -> int:
        """Virtual address of page data in this process (for RDMA registration)."""
        return self.tensor.data_ptr()

    @property
    def base_address(self) -> int:
        return self.data_address - self.header.data_offset

    def record_address(self, slot: int) -> int:
        return self.base_address + HEADER_BYTES + slot * SLOT_BYTES

    def owner_alive(self) -> bool:
        """Whether the process that created this pool still runs (the same pid and start time)."""
        return self.header.owner_alive()

    # --- teardown -----------------------------------------------------------------------------------
    def close(self) -> None:
        """Drops this object's references to the mapping. The segment is unmapped when the last tensor or
        view over it is gone (torch.frombuffer keeps the mmap alive), never under a live view."""
        self.cache = self.tensor = None
        self.data_view = None
        self.completions = None
        self._mm = None
        self._closed = True

    def unlink(self) -> None:
        """Removes the name (mappings stay valid until closed). Idempotent."""
        _unlink(self.name)

    def __enter__(self) -> SharedPagePool:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
        if self.is_owner:
            self.unlink()


def _map(fd: int, size: int, populate: bool) -> mmap.mmap:
    flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
    return mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def _unlink(name: str) -> None:
    _OWNED.pop(name, None)
    unlink_segment(name)


@atexit.register
def _unlink_owned_at_exit() -> None:
    for name, pid in list(_OWNED.items()):
        if pid == os.getpid():  # a forked child must not remove its parent's segments
            _unlink(name)


@dataclass(frozen=True)
class ShmPoolFactory:
    """engine.cache.page_pool.PagePoolFactory over shared memory: what the workers hand their engine (picklable)."""

    def create(self, cache_shape: CacheShape, num_pages: int, rank: int, tag: str) -> SharedPagePool:
        state_slots = cache_shape.state.num_slots if cache_shape.state is not None else 0
        return SharedPagePool.create(KVLayout.from_cache_shape(cache_shape), num_pages, rank, tag,
                                     num_state_slots=state_slots)

    def attach(self, name: str, cache_shape: CacheShape) -> SharedPagePool:
        return SharedPagePool.attach(name, KVLayout.from_cache_shape(cache_shape))
