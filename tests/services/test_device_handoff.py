"""`--transport device` through the real services on the CPU: decode's pools are device pools exported over
the memfd IPC stand-in (CUDA / HIP IPC on a GPU), every prefill rank maps its decode rank's pool and writes
the prompt's pages in place. Outputs equal the in-process engine's; stop leaves no segment behind."""
from __future__ import annotations

import asyncio

import psutil
import pytest

from gateway.client import build_request, generate
from tests.services.conftest import MAX_TOKENS, PROMPTS, launch
from tests.services.helpers import gateway_stub
from tests.services.processes import alive, existing_segments, group_members, mapped_kv_segments

pytestmark = pytest.mark.slow  # its own TP=2 deployment


def _maps_ipc_memory(pid: int) -> bool:
    try:
        return any("memfd:pdserve-ipc" in region.path for region in psutil.Process(pid).memory_maps(grouped=True))
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


async def test_device_transport_outputs_match_and_stop_leaves_nothing(service_model, reference, tmp_path):
    """TP=2 prefill and decode over the device transport: greedy outputs (with and without speculation) equal
    the TP=1 in-process engine's; the decode pools are pdserve-kv-dev-* control segments; each prefill rank
    maps decode's IPC memory; after stop no process and no segment remains."""
    cluster = launch(service_model, tmp_path, prefill_tp=2, decode_tp=2, transport="device")
    try:
        processes = set().union(*(group_members(child.process.pid) for child in cluster.children))
        segments = mapped_kv_segments(processes)
        assert len(segments) >= 2 and all(name.startswith("pdserve-kv-dev-") for name in segments)
        for speculative in (True, False):
            async with gateway_stub(cluster.gateway_address) as stub:
                results = await asyncio.gather(*(
                    generate(stub, build_request(prompt, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                                                 speculative=None if speculative else False), timeout=300)
                    for prompt in PROMPTS[:8]))
            assert [r.token_ids for r in results] == reference[speculative][:8]
        prefill = set().union(*(group_members(c.process.pid) for c in cluster.children if c.role.startswith("prefill")))
        assert sum(_maps_ipc_memory(pid) for pid in prefill) >= 2, "both prefill ranks must map decode's pool memory"
        assert "device handoff" in "".join(log.read_text() for log in tmp_path.glob("prefill*.log"))
    finally:
        cluster.stop()
    assert not alive(processes)
    assert not existing_segments(segments)
