"""Device weight sharing (engine/weights/device_weights.py) on the CPU: MemfdIpc stands in for CUDA / HIP IPC with the
same contract (the memory lives in the exporting process and dies with it), injected where CudaIpc runs on a GPU."""
from __future__ import annotations

import multiprocessing
import os
import signal

import pytest
import torch
from torch import nn

from engine.weights import device_weights
from engine.weights.device_ipc import IpcUnavailable, MemfdIpc, ipc_for
from engine.weights.device_weights import live_users, load_device_shared
from engine.weights.weight_store import SHM_DIR, WeightKey, _unlink

CPU = torch.device("cpu")


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 4)
        self.proj = nn.Linear(4, 4)
        self.head = nn.Linear(4, 16, bias=False)
        self.head.weight = self.embed.weight  # tied: shared once
        self.register_buffer("scale", torch.empty(4), persistent=False)


def _loaded() -> Tiny:
    torch.manual_seed(0)
    model = Tiny()
    model.scale.copy_(torch.linspace(0.5, 1.5, 4))
    return model.requires_grad_(False)


def _empty() -> Tiny:
    return Tiny().requires_grad_(False)


def _must_not_load() -> Tiny:
    raise AssertionError("an importer must not read the checkpoint")


def _key(model_dir: str, device: torch.device = CPU) -> WeightKey:
    return WeightKey(model_dir, "float32", ipc_for(device).device_id(device), 1, 0)


DEVICES = [pytest.param("cpu", id="memfd"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    yield str(tmp_path)
    _unlink(_key(str(tmp_path)).segment_name)


def _exists(model_dir: str) -> bool:
    return os.path.exists(os.path.join(SHM_DIR, _key(model_dir).segment_name))


def _owner_process(model_dir: str, ready, poke, poked, closing, closed, device_name: str = "cpu") -> None:
    device = torch.device(device_name, 0) if device_name == "cuda" else CPU
    model, share = load_device_shared(_key(model_dir, device), lambda: _loaded().to(device), _empty, ipc_for(device), device)
    assert share is not None and share.owner
    ready.set()
    if poke is None:
        signal.pause()  # killed by the test
    poke.wait(60)
    model.proj.weight[0, 0] = 42.0  # the exporter writes its memory; importers must see it
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    poked.set()
    closing.set()
    share.close()
    closed.set()


def _start_owner(model_dir: str, kill: bool = False, device_name: str = "cpu"):
    context = multiprocessing.get_context("spawn")
    events = [context.Event() for _ in range(5)]
    ready, poke, poked, closing, closed = events
    process = context.Process(target=_owner_process, daemon=True,
                              args=(model_dir, ready, None if kill else poke, poked, closing, closed, device_name))
    process.start()
    assert ready.wait(120), "the owner process did not export its weights"
    return process, events


@pytest.mark.slow
@pytest.mark.parametrize("device_name", DEVICES)
def test_importer_maps_the_owners_memory_and_the_owner_outlives_it(model_dir, device_name):
    """A second process opens the exporter's tensors (no load, same bytes, writes visible both ways); the owner's
    close() unlinks the name at once but returns only after the importer has left. memfd: the CPU stand-in;
    cuda: real CUDA / HIP IPC on GPU 0."""
    device = torch.device(device_name, 0) if device_name == "cuda" else CPU
    process, (_ready, poke, poked, closing, closed) = _start_owner(model_dir, device_name=device_name)
    try:
        model, share = load_device_shared(_key(model_dir, device), _must_not_load, _empty, ipc_for(device), device)
        assert share is not None and not share.owner
        assert model.proj.weight.device.type == device.type
        reference = _loaded()
        for name, tensor in reference.state_dict().items():
            assert torch.equal(model.state_dict()[name].cpu(), tensor), name
        assert torch.equal(model.scale.cpu(), reference.scale)
        assert model.head.weight.data_ptr() == model.embed.weight.data_ptr(), "tied weights opened once"
        poke.set()
        assert poked.wait(60)
        assert model.proj.weight[0, 0].item() == 42.0, "the importer must see the exporter's memory, not a copy"
        assert closing.wait(60)
        deadline = 600
        while _exists(model_dir) and deadline:  # the owner unlinks the name first, then waits for us
            deadline -= 1
            closed.wait(0.1)
        assert not _exists(model_dir)
        assert not closed.is_set() and process.is_alive(), "the owner must wait while an importer is registered"
        share.close()
        assert closed.wait(60), "the owner must return once the last importer has left"
    finally:
        process.kill()
        process.join(30)
        _unlink(_key(model_dir, device).segment_name)


@pytest.mark.slow
def test_killed_owner_is_replaced_by_the_next_worker(model_dir):
    """SIGKILL of the owner: the next worker finds a stale READY name, removes it, loads and exports itself
    (a new owner), and nothing is left in /dev/shm after it closes."""
    process, _events = _start_owner(model_dir, kill=True)
    os.kill(process.pid, signal.SIGKILL)
    process.join(30)
    loads = []
    model, share = load_device_shared(_key(model_dir), lambda: loads.append(1) or _loaded(), _empty, MemfdIpc(), CPU)
    assert loads == [1] and share is not None and share.owner
    assert torch.equal(model.proj.weight, _loaded().proj.weight)
    share.close()
    assert not _exists(model_dir)


def test_same_process_importer_uses_the_exported_tensors(model_dir):
    """Two engines in one process: the second binds the first one's tensors (IPC cannot reopen own memory),
    and the owner's close does not wait for an importer of its own process."""
    first, owner = load_device_shared(_key(model_dir), _loaded, _empty, MemfdIpc(), CPU)
    second, importer = load_device_shared(_key(model_dir), _must_not_load, _empty, MemfdIpc(), CPU)
    assert owner.owner and not importer.owner
    assert second.proj.weight.data_ptr() == first.proj.weight.data_ptr()
    with open(os.path.join(SHM_DIR, _key(model_dir).segment_name), "rb") as file:
        assert live_users(file.fileno()) == []
    owner.close()
    importer.close()
    assert not _exists(model_dir)


class _Unreachable(MemfdIpc):
    def open(self, handle: bytes, device: torch.device) -> torch.Tensor:
        raise IpcUnavailable("test: memory not reachable")


def test_unopenable_handles_fall_back_to_a_private_copy(model_dir, monkeypatch):
    """When the owner's memory cannot be opened (IpcUnavailable), the worker loads a private copy (share None),
    leaves the users table, and the owner's segment is untouched."""
    _first, owner = load_device_shared(_key(model_dir), _loaded, _empty, MemfdIpc(), CPU)
    monkeypatch.setattr(device_weights, "_EXPORTED", {})  # as if the owner were another process
    loads = []
    model, share = load_device_shared(_key(model_dir), lambda: loads.append(1) or _loaded(), _empty, _Unreachable(), CPU)
    assert share is None and loads == [1]
    assert torch.equal(model.proj.weight, _loaded().proj.weight)
    with open(os.path.join(SHM_DIR, _key(model_dir).segment_name), "rb") as file:
        assert all(pid == 0 for pid, _ in device_weights._users(file.fileno()))
    owner.close()
    assert not _exists(model_dir)


def test_memfd_handle_of_a_dead_exporter_is_refused():
    """MemfdIpc keeps CUDA IPC's lifetime: a handle whose exporting process is gone cannot be opened."""
    import json

    _shared, handle = MemfdIpc().share(torch.arange(4.0))
    info = json.loads(handle)
    info["ticks"] = -1  # another incarnation of the pid
    with pytest.raises(IpcUnavailable):
        MemfdIpc().open(json.dumps(info).encode(), CPU)
    opened = MemfdIpc().open(handle, CPU)
    assert torch.equal(opened, torch.arange(4.0))
