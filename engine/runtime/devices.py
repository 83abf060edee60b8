"""Where the engine runs: device names, GPU lists, per-rank placement, default dtypes and the one
host-to-device copy per step. "cuda" also means ROCm (HIP builds of torch expose the same device).

Pure functions (tested on CPU): parse_gpu_list, rank_device, default_dtype_name, resolve_device.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

logger = logging.getLogger(__name__)

DEVICE_NAMES = ("auto", "cpu", "cuda")


def on_rocm() -> bool:
    """True on a HIP (ROCm) build of torch."""
    return getattr(torch.version, "hip", None) is not None


def gpu_count() -> int:
    """Visible GPUs (0 without a GPU or on a CPU-only torch)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_device(name: str, gpus_available: int | None = None) -> str:
    """"auto" | "cpu" | "cuda" -> "cpu" or "cuda". auto = cuda when a GPU is visible. ValueError for an
    unknown name or "cuda" without a GPU (the message is one line, fit for the command line)."""
    if name not in DEVICE_NAMES:
        raise ValueError(f"device must be one of {', '.join(DEVICE_NAMES)}, got {name!r}")
    available = gpu_count() if gpus_available is None else gpus_available
    if name == "auto":
        return "cuda" if available > 0 else "cpu"
    if name == "cuda" and available == 0:
        raise ValueError("device 'cuda' requested but no GPU is visible (torch.cuda.is_available() is False)")
    return name


def serving_device(name: str) -> str:
    """The device of a prefill / decode worker: "auto" means cpu there; "cuda" must be asked for (the GPU
    serving paths, device KV pools and weights shared over IPC, are not yet proven on hardware)."""
    return "cpu" if name == "auto" else name


def default_dtype_name(device: str) -> str:
    """bf16 on GPUs, fp32 on CPU."""
    return "float32" if torch.device(device).type == "cpu" else "bfloat16"


def parse_gpu_list(text: str) -> tuple[int, ...]:
    """"0-3,6" -> (0, 1, 2, 3, 6). Order kept, duplicates and empty or negative entries refused."""
    gpus: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            raise ValueError(f"gpus {text!r}: empty entry")
        low, sep, high = part.partition("-")
        try:
            first, last = int(low), int(high) if sep else int(low)
        except ValueError as error:
            raise ValueError(f"gpus {text!r}: {part!r} is not an index or a range like 0-7") from error
        if first < 0 or last < first:
            raise ValueError(f"gpus {text!r}: bad range {part!r}")
        gpus.extend(range(first, last + 1))
    if len(set(gpus)) != len(gpus):
        raise ValueError(f"gpus {text!r}: an index is listed twice")
    return tuple(gpus)


def check_gpus(tp_size: int, gpus: Sequence[int] | None, available: int) -> tuple[int, ...]:
    """The GPU of each rank: rank r -> gpus[r] (default 0 .. tp_size - 1). More ranks than listed
    GPUs, or an index beyond the visible GPUs, is a ValueError naming both numbers."""
    chosen = tuple(gpus) if gpus else tuple(range(tp_size))
    if tp_size > len(chosen):
        raise ValueError(f"tp_size {tp_size} needs {tp_size} GPUs but only {len(chosen)} are listed ({list(chosen)})")
    beyond = [g for g in chosen[:tp_size] if g >= available]
    if beyond:
        raise ValueError(f"GPU {beyond[0]} is listed but only {available} GPU(s) are visible")
    return chosen[:tp_size]


def rank_device(device: str, gpus: Sequence[int], rank: int) -> torch.device:
    """The torch device of TP rank `rank`: cpu, or cuda:gpus[rank]."""
    if device == "cpu":
        return torch.device("cpu")
    if not 0 <= rank < len(gpus):
        raise ValueError(f"rank {rank} has no GPU in {list(gpus)}")
    return torch.device("cuda", gpus[rank])


def bind_thread_to(device: torch.device) -> None:
    """Makes `device` the calling thread's current CUDA device. The current device is per thread: the
    engine is built on one thread and stepped on another (the engine thread), where it is GPU 0 unless set
    there; Triton launches on the current device and device pools read it. A no-op on CPU, without a GPU
    (FakeTensorMode) and when it is already current (the usual case: one cheap query per step)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return
    index = device.index if device.index is not None else 0
    if torch.cuda.current_device() != index:
        torch.cuda.set_device(index)


def copy_host_values(destination: torch.Tensor, values: list[int]) -> None:
    """Writes a host list into an existing device tensor (a captured graph's static input): one pinned,
    non-blocking host-to-device copy on a real GPU; a plain copy otherwise (CPU, FakeTensorMode)."""
    source = torch.tensor(values, dtype=destination.dtype)
    if destination.device.type == "cuda" and torch.cuda.is_available():
        destination.copy_(source.pin_memory(), non_blocking=True)
    else:
        destination.copy_(source)


def host_to_device(values: list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a tensor on `device`: pinned + non_blocking on a real GPU, a plain tensor otherwise."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    if not torch.cuda.is_available():  # FakeTensorMode on a CPU-only machine: no pinned memory to use
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype).pin_memory().to(device, non_blocking=True)
