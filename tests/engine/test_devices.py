"""Device placement rules: device names, GPU lists, rank -> GPU, the dtype defaults and CLI errors."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from engine.runtime.devices import (
    check_gpus, default_dtype_name, host_to_device, parse_gpu_list, rank_device, resolve_device, serving_device,
)
from engine.runtime.tp_launcher import activation_backend


def test_resolve_device():
    """auto picks cuda only when a GPU is visible; cuda without one and unknown names are errors."""
    assert resolve_device("auto", gpus_available=0) == "cpu"
    assert resolve_device("auto", gpus_available=2) == "cuda"
    assert resolve_device("cpu", gpus_available=8) == "cpu"
    with pytest.raises(ValueError, match="no GPU is visible"):
        resolve_device("cuda", gpus_available=0)
    with pytest.raises(ValueError, match="device must be one of"):
        resolve_device("tpu", gpus_available=0)
    assert serving_device("auto") == "cpu" and serving_device("cuda") == "cuda"


def test_parse_gpu_list():
    """Ranges and lists keep their order; duplicates, gaps and junk are refused."""
    assert parse_gpu_list("0-7") == tuple(range(8))
    assert parse_gpu_list("3,1, 5-6") == (3, 1, 5, 6)
    for bad in ("", "0,,1", "a", "3-1", "0,0", "-1"):
        with pytest.raises(ValueError):
            parse_gpu_list(bad)


def test_rank_to_gpu_and_too_many_ranks():
    """Rank r uses the r-th listed GPU; more ranks than listed (or visible) GPUs is a clear error."""
    assert check_gpus(2, (4, 6), available=8) == (4, 6)
    assert check_gpus(2, None, available=2) == (0, 1)
    assert rank_device("cuda", (4, 6), 1) == torch.device("cuda", 6)
    assert rank_device("cpu", (), 3) == torch.device("cpu")
    with pytest.raises(ValueError, match="tp_size 4 needs 4 GPUs but only 2 are listed"):
        check_gpus(4, (0, 1), available=8)
    with pytest.raises(ValueError, match="GPU 3 is listed but only 2"):
        check_gpus(2, (0, 3), available=2)


def test_defaults_per_device():
    """bf16 on GPUs, fp32 on CPU; NCCL for GPU activations, gloo on CPU."""
    assert default_dtype_name("cpu") == "float32" and default_dtype_name("cuda") == "bfloat16"
    assert activation_backend("cuda") == "nccl" and activation_backend("cpu") == "gloo"


def test_host_to_device_on_cpu():
    """The one-copy helper keeps values and dtype."""
    out = host_to_device([3, 1, 2], torch.int64, torch.device("cpu"))
    assert out.tolist() == [3, 1, 2] and out.dtype == torch.int64


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
@pytest.mark.parametrize("command", ["prefill", "decode", "up"])
def test_cli_cuda_without_gpu_is_one_line_exit_2(command):
    """`--device cuda` on a machine without a GPU: one line on stderr, exit code 2, nothing started."""
    result = subprocess.run([sys.executable, "-m", "pdserve.cli", command, "--device", "cuda"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "no GPU is visible" in lines[0], result.stderr


def test_aiter_refuses_fp32_at_start_up(monkeypatch):
    """On ROCm, asking AITER for an fp32 model fails when the backend is chosen, naming the dtype (auto
    then falls back to triton) - not at the first decode step."""
    from engine.attention import registry

    monkeypatch.setattr(registry, "_on_rocm", lambda: True)
    with pytest.raises(ValueError, match="float32"):
        registry._make_aiter(torch.device("cuda"), "float32")


class _FakeCudaDevices:
    """torch.cuda's per-thread current device, as the CUDA runtime keeps it (a thread starts on GPU 0)."""

    def __init__(self) -> None:
        import threading

        self._local = threading.local()

    def current_device(self) -> int:
        return getattr(self._local, "index", 0)

    def set_device(self, index) -> None:
        self._local.index = index.index if isinstance(index, torch.device) else int(index)


def test_model_runner_steps_bind_their_gpu_on_the_stepping_thread(monkeypatch):
    """A runner built for cuda:5 on one thread and stepped on another (the engine thread) makes cuda:5 the
    stepping thread's current device before any launch: Triton kernels and device pools use the current
    device, which a new thread has at 0 (`--gpus 4-7` would have launched rank 1's kernels on GPU 0)."""
    import threading

    from engine.runtime.model_runner import ModelRunner
    from engine.runtime.step_plan import AttachPoolsPlan

    fake = _FakeCudaDevices()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", fake.current_device)
    monkeypatch.setattr(torch.cuda, "set_device", fake.set_device)
    runner = ModelRunner.__new__(ModelRunner)  # only what execute() reads: the device and the cache lookup
    runner.device = torch.device("cuda", 5)
    seen: list[int] = []
    runner._cache_for = lambda pool_names: seen.append(torch.cuda.current_device())
    stepping = threading.Thread(target=runner.execute, args=(AttachPoolsPlan(("pool",)),))
    stepping.start()
    stepping.join()
    assert seen == [5]
    assert fake.current_device() == 0  # this thread's device is untouched


def test_bind_thread_to_is_a_no_op_on_cpu_and_without_a_gpu(monkeypatch):
    """CPU devices, and cuda without a visible GPU (FakeTensorMode runs), never call set_device."""
    from engine.runtime.devices import bind_thread_to

    monkeypatch.setattr(torch.cuda, "set_device", lambda index: pytest.fail("set_device called"))
    bind_thread_to(torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    bind_thread_to(torch.device("cuda", 3))
