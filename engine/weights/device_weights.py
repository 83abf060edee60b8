"""One copy of the weights per device: the first worker on a device loads its shard there and exports
device IPC handles of its tensors; every other worker on that device (prefill and decode ranks with the
same shard) opens them instead of loading.

Ownership goes through the same /dev/shm ownership file as the CPU store (engine/weights/weight_store.py: one
name per checkpoint, dtype, device, TP size / rank and role; the header names the owner pid and its
start time), but the file holds no tensor bytes, only a manifest of IPC handles (engine/weights/device_ipc.py)
and a table of the importers now using them:

    [header (weight_store.HEADER) | users table at USERS_OFFSET | ... 4 KiB] [manifest JSON]

Lifetime (device memory dies with its exporter): an importer registers in the users table (under an
fcntl lock on the file) before opening a handle and leaves it when it closes. The owner, when it closes,
marks the file CLOSING (no new importer registers), unlinks its name and waits until every registered
importer that is still alive has left, bounded by `linger_s`. An importer that finds the owner gone
(SIGKILL) removes the stale name and loads the weights itself, becoming the new owner; one whose handles
cannot be opened (IpcUnavailable) loads a private copy."""
from __future__ import annotations

import atexit
import base64
import fcntl
import json
import logging
import os
import struct
import time
from collections.abc import Callable

import psutil
import torch
from torch import nn

from engine.weights.device_ipc import DeviceIpc, IpcUnavailable
from engine.weights.weight_store import (
    HEADER_BYTES, READY, WeightKey, _bind, _claim, _named_tensors, load_claimed, _owner_alive, _read_header,
    _unlink_if_same, _wait_ready, _write_header,
)

logger = logging.getLogger(__name__)

CLOSING = 2
USERS_OFFSET = 512
USER = struct.Struct("<Qd")  # pid, process create time (0, 0: a free slot)
MAX_USERS = (HEADER_BYTES - USERS_OFFSET) // USER.size
_EXPORTED: dict[str, dict[str, torch.Tensor]] = {}  # segment name -> tensors this process exported


def _users(fd: int) -> list[tuple[int, float]]:
    raw = os.pread(fd, MAX_USERS * USER.size, USERS_OFFSET)
    return [USER.unpack_from(raw, i * USER.size) for i in range(MAX_USERS)]


def live_users(fd: int) -> list[int]:
    """Pids of the registered importers that are still alive, this process excepted (an importer in the
    exporting process uses the exported tensors themselves, not IPC)."""
    return [pid for pid, created in _users(fd) if pid and pid != os.getpid() and _owner_alive(pid, created)]


def _register(fd: int) -> bool:
    """Adds this process to the users table; False when the owner is closing or gone (or the table is full)."""
    me = psutil.Process()
    fcntl.lockf(fd, fcntl.LOCK_EX)
    try:
        header = _read_header(fd)
        if header is None or header[0] != READY or not _owner_alive(header[1], header[2]):
            return False
        for index, (pid, created) in enumerate(_users(fd)):
            if not pid or not _owner_alive(pid, created):
                os.pwrite(fd, USER.pack(me.pid, me.create_time()), USERS_OFFSET + index * USER.size)
                return True
        logger.warning("device weight users table full (%d); loading a private copy", MAX_USERS)
        return False
    finally:
        fcntl.lockf(fd, fcntl.LOCK_UN)


def _deregister(fd: int) -> None:
    fcntl.lockf(fd, fcntl.LOCK_EX)
    try:
        for index, (pid, _created) in enumerate(_users(fd)):
            if pid == os.getpid():
                os.pwrite(fd, USER.pack(0, 0.0), USERS_OFFSET + index * USER.size)
    finally:
        fcntl.lockf(fd, fcntl.LOCK_UN)


class DeviceWeights:
    """This process's part in a device weight share: owner (exported) or importer (registered)."""

    def __init__(self, name: str, fd: int, owner: bool, nbytes: int, linger_s: float) -> None:
        self.name, self.owner, self.bytes, self.linger_s = name, owner, nbytes, linger_s
        self._fd = fd
        atexit.register(self.close)

    def close(self) -> None:
        """Importer: leaves the users table. Owner: stops new importers, unlinks the name, then waits for
        the live importers to leave (at most linger_s) so their device memory stays valid while they run."""
        if self._fd < 0:
            return
        fd, self._fd = self._fd, -1
        try:
            if not self.owner:
                _deregister(fd)
                return
            fcntl.lockf(fd, fcntl.LOCK_EX)
            header = _read_header(fd)
            _write_header(fd, CLOSING, *(header[3:] if header else (0, 0)))
            fcntl.lockf(fd, fcntl.LOCK_UN)
            _unlink_if_same(self.name, fd)
            deadline = time.monotonic() + self.linger_s
            while live_users(fd) and time.monotonic() < deadline:
                time.sleep(0.05)  # waiting on other processes' exit, not synchronising a test
            left = live_users(fd)
            if left:
                logger.warning("device weights %s: importers %s still running after %.0f s", self.name, left, self.linger_s)
            _EXPORTED.pop(self.name, None)
        finally:
            os.close(fd)


def _export(fd: int, name: str, model: nn.Module, ipc: DeviceIpc) -> int:
    """Shares every tensor (tied ones once), binds the shared ones, writes the manifest; marks READY."""
    entries, seen, shared_by_name, nbytes = [], {}, {}, 0
    for tensor_name, tensor in _named_tensors(model):
        key = (tensor.data_ptr(), tuple(tensor.shape), tensor.dtype) if tensor.numel() else None
        if key is not None and key in seen:
            entries.append({**seen[key], "name": tensor_name})
            shared_by_name[tensor_name] = shared_by_name[seen[key]["name"]]
            continue
        shared, handle = ipc.share(tensor.detach().contiguous())
        entry = {"name": tensor_name, "handle": base64.b64encode(handle).decode("ascii")}
        entries.append(entry)
        shared_by_name[tensor_name] = shared
        nbytes += tensor.numel() * tensor.element_size()
        if key is not None:
            seen[key] = entry
    for tensor_name, shared in shared_by_name.items():
        _bind(model, tensor_name, shared)
    manifest = json.dumps({"data_bytes": nbytes, "tensors": entries}).encode()
    os.ftruncate(fd, HEADER_BYTES + len(manifest))
    os.pwrite(fd, manifest, HEADER_BYTES)
    _write_header(fd, READY, HEADER_BYTES, len(manifest))
    _EXPORTED[name] = shared_by_name
    return nbytes


def _import(fd: int, name: str, model: nn.Module, ipc: DeviceIpc, device: torch.device) -> int:
    """Opens every handle of the manifest and binds it into `model`; returns the bytes mapped."""
    _state, _pid, _created, offset, length = _read_header(fd)
    manifest = json.loads(os.pread(fd, length, offset))
    names = {tensor_name for tensor_name, _ in _named_tensors(model)}
    listed = {entry["name"] for entry in manifest["tensors"]}
    if names != listed:
        raise ValueError(f"device weights {name} do not match the model built here: missing "
                         f"{sorted(names - listed)[:5]}, extra {sorted(listed - names)[:5]}")
    opened: dict[str, torch.Tensor] = {}
    local = _EXPORTED.get(name)  # the owner is this very process: IPC cannot open its own memory
    for entry in manifest["tensors"]:
        handle = entry["handle"]
        if handle not in opened:
            opened[handle] = local[entry["name"]] if local else ipc.open(base64.b64decode(handle), device)
        _bind(model, entry["name"], opened[handle])
    return manifest["data_bytes"]


def load_device_shared(key: WeightKey, load: Callable[[], nn.Module], build_empty: Callable[[], nn.Module],
                       ipc: DeviceIpc, device: torch.device, timeout_s: float = 1800.0,
                       linger_s: float = 60.0) -> tuple[nn.Module, DeviceWeights | None]:
    """The model for `key` (key.device: ipc.device_id(device)) on `device`, its weights shared on the device.
    Returns (model, share); share is None when the model holds a private copy (fallback)."""
    name = key.segment_name
    while True:
        fd = _claim(name)
        if fd is not None:
            model, nbytes = load_claimed(fd, name, load, lambda claimed, loaded: _export(claimed, name, loaded, ipc))
            logger.info("weights %s: loaded on %s and exported over IPC (%.1f MiB)", name, device, nbytes / 2**20)
            return model, DeviceWeights(name, fd, True, nbytes, linger_s)
        fd = _wait_ready(name, timeout_s)
        if fd is None:
            continue
        ready, fd = fd, os.open(f"/proc/self/fd/{fd}", os.O_RDWR)  # the same segment read/write, not the name again
        os.close(ready)
        if not _register(fd):
            header = _read_header(fd)
            gone = header is not None and not _owner_alive(header[1], header[2])
            if gone:
                logger.warning("weights %s: the owner (pid %d) is gone; loading and exporting here", name, header[1])
                _unlink_if_same(name, fd)
            os.close(fd)
            if gone:
                continue
            return load(), None
        try:
            model = build_empty()
            nbytes = _import(fd, name, model, ipc, device)
        except (IpcUnavailable, ValueError) as error:
            _deregister(fd)
            os.close(fd)
            logger.warning("weights %s: cannot open the owner's device memory (%s); loading a private copy", name, error)
            return load(), None
        logger.info("weights %s: opened the device copy of pid %d (%.1f MiB)", name, _read_header(fd)[1], nbytes / 2**20)
        return model, DeviceWeights(name, fd, False, nbytes, linger_s)
