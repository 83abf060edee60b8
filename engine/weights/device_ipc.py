"""Handing device memory to another process on the same node: one small contract, two layers.

    ipc.device_id(device) -> str             the physical device (same id: the same memory is reachable)
    ipc.share(tensor) -> (tensor, handle)    the tensor to keep using (same memory) and bytes naming it
    ipc.open(handle, device) -> tensor       maps the exporter's memory in this process (no copy)

CudaIpc: CUDA / HIP IPC through torch.multiprocessing.reductions (cudaIpcGetMemHandle of the caching
allocator's block + offset; torch opens each block once per process). The exporter must stay alive while
others use the memory. MemfdIpc: the CPU stand-in with the same contract and the same lifetime: the bytes
live in an anonymous memfd of the exporting process and are opened through /proc/<pid>/fd/<fd>, so they
vanish with the exporter (nothing in /dev/shm) and open() fails once it is gone. It is what the device
paths use on the CPU (tests, CPU nodes), and what tests inject where CudaIpc would run on a GPU.
A handle is JSON (MemfdIpc) or a pickle that only torch classes may appear in (CudaIpc)."""
from __future__ import annotations

import io
import json
import mmap
import os
import pickle
import warnings
from typing import Protocol

import torch

from rpc.processes import node_id, start_ticks

_TORCH_MODULES = ("torch", "torch.storage", "torch._utils", "torch.multiprocessing.reductions", "collections")


class IpcUnavailable(RuntimeError):
    """The memory cannot be opened here (exporter gone, no GPU, another node): fall back to a copy."""


class DeviceIpc(Protocol):
    def device_id(self, device: torch.device) -> str: ...

    def share(self, tensor: torch.Tensor) -> tuple[torch.Tensor, bytes]: ...

    def open(self, handle: bytes, device: torch.device) -> torch.Tensor: ...


class _TorchOnlyUnpickler(pickle.Unpickler):
    """A CUDA handle only ever holds torch's rebuild function and plain values; refuse anything else."""

    def find_class(self, module: str, name: str):
        if module in _TORCH_MODULES or module.startswith("torch."):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"unexpected {module}.{name} in a device IPC handle")


class CudaIpc:
    """CUDA / HIP IPC of caching-allocator tensors (picklable: TP followers get it in their config)."""

    def device_id(self, device: torch.device) -> str:
        if not torch.cuda.is_available():
            raise IpcUnavailable("CUDA / HIP IPC needs a GPU, and this process sees none")
        return f"cuda:{torch.cuda.get_device_properties(device).uuid}"

    def share(self, tensor: torch.Tensor) -> tuple[torch.Tensor, bytes]:
        from torch.multiprocessing.reductions import reduce_tensor

        if not tensor.is_cuda:
            raise ValueError("CudaIpc.share needs a device tensor")
        rebuild, args = reduce_tensor(tensor)
        return tensor, pickle.dumps((self.device_id(tensor.device), rebuild, args))

    def open(self, handle: bytes, device: torch.device) -> torch.Tensor:
        if not torch.cuda.is_available():
            raise IpcUnavailable("CUDA / HIP IPC needs a GPU, and this process sees none")
        _device, rebuild, args = _TorchOnlyUnpickler(io.BytesIO(handle)).load()
        try:
            return rebuild(*args)
        except RuntimeError as error:  # the exporter is gone, or the handle names another node's memory
            raise IpcUnavailable(f"cannot open a CUDA IPC handle: {error}") from error


class MemfdIpc:
    """The CPU stand-in: memory in a memfd owned by the exporting process (see the module docstring)."""

    def __init__(self) -> None:
        self._keep: list[tuple[int, mmap.mmap]] = []  # exported memfds stay open while this process lives

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self._keep = []

    def device_id(self, device: torch.device) -> str:
        return f"cpu:{node_id()}"

    def share(self, tensor: torch.Tensor) -> tuple[torch.Tensor, bytes]:
        if tensor.device.type != "cpu":
            raise ValueError("MemfdIpc.share needs a CPU tensor")
        nbytes = max(tensor.numel() * tensor.element_size(), 1)
        fd = os.memfd_create("pdserve-ipc", os.MFD_CLOEXEC)
        os.ftruncate(fd, nbytes)
        mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
        self._keep.append((fd, mapping))
        shared = _tensor_over(mapping, tensor.dtype, tuple(tensor.shape))
        shared.copy_(tensor)
        handle = {"pid": os.getpid(), "ticks": start_ticks(os.getpid()), "fd": fd, "nbytes": nbytes, "dtype": str(tensor.dtype).removeprefix("torch."),
                  "shape": list(tensor.shape), "device": self.device_id(tensor.device)}
        return shared, json.dumps(handle).encode()

    def open(self, handle: bytes, device: torch.device) -> torch.Tensor:
        info = json.loads(handle)
        if info["device"] != self.device_id(device):
            raise IpcUnavailable(f"memory of {info['device']} is not reachable from this node")
        if start_ticks(int(info["pid"])) != info["ticks"]:
            raise IpcUnavailable(f"the exporter (pid {info['pid']}) is gone")
        try:
            fd = os.open(f"/proc/{int(info['pid'])}/fd/{int(info['fd'])}", os.O_RDWR)
        except OSError as error:
            raise IpcUnavailable(f"the exporter (pid {info['pid']}) is gone: {error}") from error
        try:
            if os.fstat(fd).st_size < info["nbytes"]:
                raise IpcUnavailable("the handle names other memory (size differs): the exporter is gone")
            mapping = mmap.mmap(fd, info["nbytes"], flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        return _tensor_over(mapping, getattr(torch, info["dtype"]), tuple(info["shape"]))


def _tensor_over(mapping: mmap.mmap, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    count = 1
    for size in shape:
        count *= size
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        flat = torch.frombuffer(mapping, dtype=dtype, count=count) if count else torch.empty(0, dtype=dtype)
    return flat.view(shape)


def handle_device(handle: bytes) -> str:
    """The device id recorded in a handle of either layer (the memory's device, as device_id() names it)."""
    if handle[:1] == b"{":
        return str(json.loads(handle)["device"])
    return str(_TorchOnlyUnpickler(io.BytesIO(handle)).load()[0])


def ipc_for(device: torch.device | str) -> DeviceIpc:
    """The layer for a device: CudaIpc on "cuda" (ROCm too), MemfdIpc on the CPU."""
    return CudaIpc() if torch.device(device).type == "cuda" else MemfdIpc()
