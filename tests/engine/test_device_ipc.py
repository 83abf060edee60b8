"""The device IPC contract's guards on a CPU-only machine: CudaIpc refuses clearly without a GPU and never
unpickles anything but torch classes from a handle; MemfdIpc handles name their device."""
from __future__ import annotations

import os
import pickle

import pytest
import torch

from engine.weights.device_ipc import CudaIpc, IpcUnavailable, MemfdIpc, handle_device, ipc_for


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU guard")
def test_cuda_ipc_without_a_gpu_is_unavailable():
    """device_id and open raise IpcUnavailable (callers fall back to a private copy), naming the missing GPU."""
    with pytest.raises(IpcUnavailable, match="GPU"):
        CudaIpc().device_id(torch.device("cuda", 0))
    with pytest.raises(IpcUnavailable, match="GPU"):
        CudaIpc().open(pickle.dumps(("cuda:x", None, ())), torch.device("cuda", 0))


def test_cuda_handle_refuses_non_torch_classes(monkeypatch):
    """A handle whose pickle names anything outside torch (here os.system) is refused before it is called."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    forged = pickle.dumps(("cuda:x", os.system, ("echo forged",)))
    with pytest.raises(pickle.UnpicklingError, match="unexpected"):
        CudaIpc().open(forged, torch.device("cuda", 0))
    with pytest.raises(pickle.UnpicklingError):
        handle_device(forged)


def test_memfd_share_keeps_values_and_names_the_node():
    """share() returns a tensor over the exported memory with the same values; the handle records the node's
    device id; ipc_for picks MemfdIpc on the CPU and CudaIpc on cuda."""
    ipc = MemfdIpc()
    source = torch.arange(12, dtype=torch.float32).view(3, 4)
    shared, handle = ipc.share(source)
    assert torch.equal(shared, source) and shared.data_ptr() != source.data_ptr()
    assert handle_device(handle) == ipc.device_id(torch.device("cpu"))
    assert isinstance(ipc_for("cpu"), MemfdIpc) and isinstance(ipc_for("cuda"), CudaIpc)
