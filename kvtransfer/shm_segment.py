"""The shm pool segment's on-disk identity: its name, its header (magic, layout, owner pid and start time,
geometry), whether its owner still lives, and the start-up cleanup of segments whose owner died."""
from __future__ import annotations

import logging
import os
import struct
import time
from dataclasses import dataclass

from kvtransfer.completion import SLOT_BYTES
from kvtransfer.errors import SegmentError
from rpc.processes import start_ticks

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "pdserve-kv-"
MAGIC = b"PDSKVP01"
HEADER_BYTES = 4096  # the header struct, padded; completion slots follow
HEADER = struct.Struct("<8sIQQQQQIII16s32s256sI")
VERSION = 2  # 2: num_state_slots (linear-attention state slots after the pages)


@dataclass(frozen=True)
class PoolHeader:
    owner_pid: int
    owner_start_ticks: int
    num_pages: int
    data_offset: int
    data_bytes: int
    num_slots: int
    rank: int
    layout_hash: str
    owner_tag: str
    layout_canonical: str
    num_state_slots: int = 0

    def pack(self) -> bytes:
        return HEADER.pack(
            MAGIC, VERSION, self.owner_pid, self.owner_start_ticks, self.num_pages, self.data_offset, self.data_bytes,
            self.num_slots, SLOT_BYTES, self.rank, self.layout_hash.encode("ascii"),
            self.owner_tag.encode("utf-8")[:32], self.layout_canonical.encode("ascii")[:256], self.num_state_slots,
        )

    @classmethod
    def unpack(cls, raw: bytes, name: str) -> PoolHeader:
        if len(raw) < HEADER.size:
            raise SegmentError(f"shm segment {name} is too short for a pool header")
        magic, version, pid, started, pages, offset, nbytes, slots, slot_bytes, rank, lhash, tag, canon, states = (
            HEADER.unpack_from(raw)
        )
        if magic != MAGIC or version != VERSION or slot_bytes != SLOT_BYTES:
            raise SegmentError(f"shm segment {name} is not a pdserve KV pool (bad magic or version)")
        strip = lambda value: value.rstrip(b"\0").decode("utf-8", "replace")  # noqa: E731
        return cls(pid, started, pages, offset, nbytes, slots, rank, strip(lhash), strip(tag), strip(canon), states)

    def owner_alive(self) -> bool:
        try:
            os.kill(self.owner_pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        started = start_ticks(self.owner_pid)
        if started is None or not self.owner_start_ticks:  # cannot tell: trust kill()
            return True
        return started == self.owner_start_ticks  # 0 (zombie) or another start time (pid reused): gone


def unlink_segment(name: str) -> None:
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        pass


def cleanup_stale_segments(prefix: str = SEGMENT_PREFIX, grace_s: float = 60.0) -> list[str]:
    """Removes pool segments whose owner process is dead; returns their names. Call at start-up.

    A segment without a readable header is removed only once it is older than grace_s (it may be one
    being created right now).
    """
    removed = []
    for name in sorted(os.listdir(SHM_DIR)):
        if not name.startswith(prefix):
            continue
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            info = os.fstat(fd)
            if info.st_uid != os.getuid():
                continue
            try:
                stale = not PoolHeader.unpack(os.pread(fd, HEADER.size, 0), name).owner_alive()
            except SegmentError:
                stale = time.time() - info.st_mtime > grace_s
        finally:
            os.close(fd)
        if stale:
            unlink_segment(name)
            removed.append(name)
            logger.warning("removed stale KV pool segment %s (owner gone)", name)
    return removed
