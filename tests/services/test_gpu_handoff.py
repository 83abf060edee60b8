"""On one GPU (scripts/gpu_check.sh): a prefill and a decode worker share the weights over CUDA / HIP IPC
(the device's used memory grows by about one copy of the weights, not two) and the KV pages go device to
device (the decode pool is a device pool, prefill writes it in place); greedy outputs equal the CPU path's.
Skipped without a GPU: on the CPU the same code runs over the memfd stand-in (test_device_handoff.py,
tests/engine/test_device_weights.py)."""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from gateway.client import build_request, generate
from pdserve.launcher import Cluster, ClusterSpec
from tests.services.conftest import MAX_TOKENS, PROMPTS
from tests.services.helpers import gateway_stub
from tests.services.processes import group_members, mapped_kv_segments
from tests.services.test_shared_weights import big_model  # noqa: F401 - the checkpoint fixture

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
GPU_ARGS = ("--device", "cuda", "--gpus", "0", "--no-graphs", "--kv-memory-mb", "64")


def _device_used_bytes() -> int:
    free, total = torch.cuda.mem_get_info(0)
    return total - free


def _start(model: Path, log_dir: Path, extra: tuple[str, ...] = ()) -> Cluster:
    spec = ClusterSpec(model_dir=str(model), listen="127.0.0.1:0", attention_backend="torch", draft_model="",
                       worker_args=GPU_ARGS + extra, http_listen="")
    log_dir.mkdir(parents=True, exist_ok=True)
    cluster = Cluster(spec, log_dir=log_dir)
    cluster.start(timeout_s=300)
    return cluster


def _greedy(address: str, prompts: list[list[int]]) -> list[list[int]]:
    async def run() -> list[list[int]]:
        async with gateway_stub(address) as stub:
            results = await asyncio.gather(*(
                generate(stub, build_request(p, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                                             speculative=False), timeout=300) for p in prompts))
        return [r.token_ids for r in results]

    return asyncio.run(run())


@pytest.fixture(scope="module")
def gpu_model(big_model: tuple[Path, int]) -> tuple[Path, int]:
    """The ~236 MB (fp32 on disk) random DeepSeek-V3-shaped checkpoint and its weight bytes in bf16 on the GPU."""
    model, fp32_bytes = big_model
    return model, fp32_bytes // 2


def test_one_gpu_workers_share_one_copy_of_the_weights(gpu_model, tmp_path):
    """Prefill + decode on GPU 0 with sharing on use at least 0.75x the weight bytes less device memory than
    with --no-shared-weights (the importer maps the owner's tensors: ~1x weights on the device, not 2x)."""
    model, weight_bytes = gpu_model
    used = {}
    for share in (True, False):
        before = _device_used_bytes()
        cluster = _start(model, tmp_path / f"share-{share}", () if share else ("--no-shared-weights",))
        try:
            _greedy(cluster.gateway_address, PROMPTS[:2])
            used[share] = _device_used_bytes() - before
        finally:
            cluster.stop()
    saved = used[False] - used[True]
    print(f"device memory of the node: shared {used[True] / 2**20:.0f} MiB, private {used[False] / 2**20:.0f} MiB, "  # noqa: T201
          f"weights {weight_bytes / 2**20:.0f} MiB, saved {saved / weight_bytes:.2f}x weights")
    assert saved >= 0.75 * weight_bytes, (used, weight_bytes)


def test_pages_go_device_to_device_and_outputs_equal_the_cpu_path(service_model, reference, tmp_path):
    """fp32 on the GPU, transport auto: the decode pool is a device pool (pdserve-kv-dev-*), prefill logs device
    handoffs, and the greedy outputs equal the in-process CPU engine's."""
    cluster = _start(service_model, tmp_path, ("--dtype", "float32"))
    try:
        processes = set().union(*(group_members(child.process.pid) for child in cluster.children))
        segments = mapped_kv_segments(processes)
        assert segments and all(name.startswith("pdserve-kv-dev-") for name in segments)
        outputs = _greedy(cluster.gateway_address, PROMPTS[:8])
    finally:
        cluster.stop()
    assert outputs == reference[False][:8]
    assert "device handoff" in "".join(log.read_text() for log in tmp_path.glob("prefill*.log"))
