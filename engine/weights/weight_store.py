"""One copy of the weights per node: a read-only shared-memory store that every worker on the node maps.

The first worker whose rank needs a shard (same checkpoint, dtype, device, TP size and rank) claims the
segment, loads the checkpoint as usual, copies every parameter and buffer into the segment, marks it ready
and re-points its own tensors at read-only views of it (its private copy is freed). Later workers build the
model with uninitialised tensors (torch.empty: untouched pages cost no memory), wait until the segment is ready and bind the same views: the pages
are shared, so the weights are resident once however many workers run.

Segment: /dev/shm/pdserve-w-<key> (0600) = [header 4 KiB][tensor bytes, 64-byte aligned][manifest JSON].
Lifetime: a mapping outlives the segment's name, so whoever leaves last needs nothing from the name. The
owner unlinks it when it exits; a process that exits after the owner died (SIGKILL) unlinks it for it;
`remove_stale_segments` (called by `pdserve up` at start and stop) removes segments whose owner is gone.
A worker that starts after the name was removed simply creates a fresh segment. A name is removed only while
it still names the segment the remover has open (`_unlink_if_same`): the same key's name is reused by the next
loader, which a late exit of an older segment's user must leave alone.
"""
from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import hashlib
import json
import logging
import mmap
import os
import struct
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch
from torch import nn

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
PREFIX = "pdserve-w-"
MAGIC = b"PDSWTS01"
HEADER = struct.Struct("<8sIQdQQ")  # magic, state, owner pid, owner create time, manifest offset, manifest bytes
HEADER_BYTES = 4096
ALIGN = 64
LOADING, READY = 0, 1


@dataclass(frozen=True)
class WeightKey:
    """What makes two workers' weights byte-identical: the checkpoint files, how they were loaded and
    which shard. `signature` covers the checkpoint's file names, sizes and modification times."""

    model_dir: str
    dtype: str
    device: str
    tp_size: int
    tp_rank: int
    role: str = "target"

    @property
    def signature(self) -> str:
        root = Path(self.model_dir).resolve()
        files = sorted(p for p in root.iterdir() if p.suffix in (".safetensors", ".json") and p.is_file())
        parts = [f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files]
        return "|".join([str(root), self.dtype, self.device, str(self.tp_size), str(self.tp_rank), self.role, *parts])

    @property
    def segment_name(self) -> str:
        return PREFIX + hashlib.sha256(self.signature.encode()).hexdigest()[:24]


def _owner_alive(pid: int, create_time: float) -> bool:
    try:
        process = psutil.Process(pid)
        return abs(process.create_time() - create_time) < 0.5 and process.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def _read_header(fd: int) -> tuple[int, int, float, int, int] | None:
    raw = os.pread(fd, HEADER.size, 0)
    if len(raw) < HEADER.size:
        return None
    magic, state, pid, created, offset, length = HEADER.unpack(raw)
    return (state, pid, created, offset, length) if magic == MAGIC else None


def _unlink(name: str) -> None:
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        pass


def _unlink_if_same(name: str, fd: int) -> None:
    """Removes `name` only while it still names the segment open as fd. Names are reused (one per weight key): a
    process that exits after its segment's name was removed and claimed again (another deployment of the same
    checkpoint, or a worker that reloaded) must not remove the newer segment, whose loader would then find its
    own name gone or taken by a third loader's half-written one."""
    try:
        now, mine = os.stat(os.path.join(SHM_DIR, name), follow_symlinks=False), os.fstat(fd)
    except FileNotFoundError:
        return
    if (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino):
        _unlink(name)


def remove_stale_segments(grace_s: float = 60.0, prefix: str = PREFIX) -> list[str]:
    """Removes weight segments (names starting with prefix) whose owner is gone (a header-less one only after
    grace_s); returns names."""
    removed = []
    for name in sorted(os.listdir(SHM_DIR)):
        if not name.startswith(prefix):
            continue
        try:
            fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            header = _read_header(fd)
            stale = (time.time() - os.fstat(fd).st_mtime > grace_s) if header is None else not _owner_alive(
                header[1], header[2])
            if stale:
                _unlink_if_same(name, fd)
                removed.append(name)
        finally:
            os.close(fd)
    if removed:
        logger.info("removed %d stale weight segment(s)", len(removed))
    return removed


def _named_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer, tied ones included under each name."""
    named = list(model.named_parameters(remove_duplicate=False))
    named += [(n, b) for n, b in model.named_buffers(remove_duplicate=False) if b is not None]
    return named


def _bind(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    owner_path, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner_path) if owner_path else model
    if leaf in module._parameters:
        module._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)
    else:
        module._buffers[leaf] = tensor


class SharedWeights:
    """A mapped weight segment: `views()` gives the manifest's read-only tensors."""

    def __init__(self, name: str, fd: int, owner: bool) -> None:
        self.name = name
        self.owner = owner
        self._fd = fd
        size = os.fstat(fd).st_size
        self._map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        _state, self.owner_pid, self.owner_created, offset, length = _read_header(fd)
        self.manifest = json.loads(self._map[offset : offset + length])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # read-only buffer: writes would fault, which is the point
            self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        self.bytes = self.manifest["data_bytes"]
        atexit.register(self.close)

    def views(self) -> dict[str, torch.Tensor]:
        out = {}
        for entry in self.manifest["tensors"]:
            start, nbytes = entry["offset"], entry["nbytes"]
            dtype = getattr(torch, entry["dtype"])
            out[entry["name"]] = self._bytes[start : start + nbytes].view(dtype).view(entry["shape"])
        return out

    def bind(self, model: nn.Module) -> None:
        """Points every parameter and buffer of `model` (built with the same code) at the shared views."""
        views = self.views()
        names = {name for name, _ in _named_tensors(model)}
        if names != set(views):
            raise ValueError(f"shared weight segment {self.name} does not match the model: "
                             f"missing {sorted(names - set(views))[:5]}, extra {sorted(set(views) - names)[:5]}")
        for name, tensor in views.items():
            _bind(model, name, tensor)

    def close(self) -> None:
        """Unlinks the name when this process owns it or the owner died; the mapping stays valid."""
        if self._fd < 0:
            return
        if self.owner or not _owner_alive(self.owner_pid, self.owner_created):
            _unlink_if_same(self.name, self._fd)
        os.close(self._fd)
        self._fd = -1


def _return_freed_memory() -> None:
    """Hands the heap pages of the freed private copy back to the OS (glibc keeps them otherwise)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None)
    if trim is not None:
        trim(0)


def _publish(fd: int, model: nn.Module) -> None:
    """Writes the model's tensors and manifest into the claimed segment, then marks it READY."""
    entries, offset, seen = [], HEADER_BYTES, {}
    tensors = _named_tensors(model)
    for name, tensor in tensors:
        key = (tensor.data_ptr(), tuple(tensor.shape), tensor.dtype) if tensor.numel() else None
        if key in seen:  # tied weights share bytes
            entries.append({**seen[key], "name": name})
            continue
        nbytes = tensor.numel() * tensor.element_size()
        entry = {"name": name, "offset": offset, "nbytes": nbytes, "shape": list(tensor.shape),
                 "dtype": str(tensor.dtype).removeprefix("torch.")}
        entries.append(entry)
        if key is not None:
            seen[key] = entry
        offset += -(-nbytes // ALIGN) * ALIGN
    manifest = json.dumps({"data_bytes": offset - HEADER_BYTES, "tensors": entries}).encode()
    os.ftruncate(fd, offset + len(manifest))
    with mmap.mmap(fd, offset + len(manifest), flags=mmap.MAP_SHARED) as writable:
        target = torch.frombuffer(writable, dtype=torch.uint8)
        for entry, (_, tensor) in zip(entries, tensors):
            flat = tensor.detach().contiguous().view(-1).view(torch.uint8) if tensor.numel() else None
            if flat is not None:
                target[entry["offset"] : entry["offset"] + entry["nbytes"]].copy_(flat)
        writable[offset : offset + len(manifest)] = manifest
        del target
        writable.flush()
    _write_header(fd, READY, offset, len(manifest))


def _write_header(fd: int, state: int, offset: int = 0, length: int = 0) -> None:
    me = psutil.Process()
    os.pwrite(fd, HEADER.pack(MAGIC, state, me.pid, me.create_time(), offset, length), 0)


def _claim(name: str) -> int | None:
    """Creates the segment exclusively (we load); None when another process has it."""
    try:
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        return None
    os.ftruncate(fd, HEADER_BYTES)
    _write_header(fd, LOADING)
    return fd


def _wait_ready(name: str, timeout_s: float) -> int | None:
    """Opens a READY segment; None when it vanished or its loader died (the caller then claims it)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            return None
        header = _read_header(fd)
        if header is not None and header[0] == READY:
            return fd
        if header is not None and not _owner_alive(header[1], header[2]):
            _unlink_if_same(name, fd)  # the loader died mid-load
            os.close(fd)
            return None
        os.close(fd)
        if time.monotonic() > deadline:
            raise TimeoutError(f"shared weights {name} not ready after {timeout_s:.0f} s")
        time.sleep(0.05)  # polling another process's progress, not synchronising a test


def load_claimed(fd: int, name: str, load: Callable[[], nn.Module],
                 publish: Callable[[int, nn.Module], object]) -> tuple[nn.Module, object]:
    """Loads the model and publishes it into the segment this process claimed (fd); on any failure the claim
    is given up (closed and unlinked) so the next worker can claim it. Returns (model, publish's result)."""
    try:
        model = load()
        return model, publish(fd, model)
    except BaseException:
        _unlink_if_same(name, fd)
        os.close(fd)
        raise


def load_shared(key: WeightKey, load: Callable[[], nn.Module], build_empty: Callable[[], nn.Module],
                timeout_s: float = 1800.0) -> tuple[nn.Module, SharedWeights]:
    """The model for `key`, its weights in the node's shared store (loaded here if nobody has yet).

    load: builds and loads the model normally; build_empty: builds it without loading (torch.empty tensors,
    never touched, so never resident; the meta device would cost ~95 MB of lazily imported torch modules)."""
    name = key.segment_name
    while True:
        fd = _claim(name)
        if fd is not None:
            model, _ = load_claimed(fd, name, load, _publish)
            shared = SharedWeights(name, fd, owner=True)  # this fd, not the name again: the name may be gone
            shared.bind(model)
            _return_freed_memory()
            logger.info("weights %s: loaded and shared (%.1f MiB)", name, shared.bytes / 2**20)
            return model, shared
        fd = _wait_ready(name, timeout_s)
        if fd is None:
            continue
        shared = SharedWeights(name, fd, owner=False)
        model = build_empty()
        shared.bind(model)
        logger.info("weights %s: mapped from the node's shared store (%.1f MiB)", name, shared.bytes / 2**20)
        return model, shared
