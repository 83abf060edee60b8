"""Shared fixtures for the kvtransfer tests, and the guard that nothing is left in /dev/shm."""
from __future__ import annotations

import os

import pytest
import torch

from engine.cache.kv_cache import PagedLatentCache
from kvtransfer.grpc_receiver import PushReceiver
from kvtransfer.grpc_servicer import serve
from kvtransfer.layout import KVLayout
from kvtransfer.shm_pool import SHM_DIR, PoolHeader

# DeepSeek-V3's latent (61 x (512 + 64), page 64, bf16) and a small default-model-like layout with draft pages.
DEEPSEEK_V3 = KVLayout(num_layers=61, latent_dim=512, rope_dim=64, page_size=64, dtype="bfloat16")
SMALL_WITH_DRAFT = KVLayout(num_layers=4, latent_dim=64, rope_dim=16, page_size=16, dtype="bfloat16",
                            draft_layers=2, draft_dim=128)


class LeakGuard:
    """Pids whose pool segments count as ours besides this process (children a test spawned)."""

    def __init__(self) -> None:
        self.pids = {os.getpid()}

    def track_pid(self, pid: int) -> None:
        self.pids.add(pid)


def _owned_kv_segments(pids: set[int]) -> set[str]:
    found = set()
    for name in os.listdir(SHM_DIR):
        if not name.startswith("pdserve-"):
            continue
        try:
            with open(os.path.join(SHM_DIR, name), "rb") as handle:
                header = PoolHeader.unpack(handle.read(4096), name)
        except (OSError, ValueError):
            continue
        if header.owner_pid in pids:
            found.add(name)
    return found


@pytest.fixture(scope="session", autouse=True)
def shm_leak_guard():
    """Every pdserve-* segment created by these tests (this process or a child it spawned) is gone at the end.

    Segments of other processes (other test sessions running on the same machine) are not ours to judge.
    """
    guard = LeakGuard()
    before = set(os.listdir(SHM_DIR))
    yield guard
    leaked = _owned_kv_segments(guard.pids) - before
    assert not leaked, f"shared-memory segments left behind: {sorted(leaked)}"


def random_cache(layout: KVLayout, num_pages: int, seed: int) -> PagedLatentCache:
    """A local cache (prefill's own pages) filled with random bits."""
    cache = PagedLatentCache(layout.to_cache_shape(num_pages))
    generator = torch.Generator().manual_seed(seed)
    raw = cache.buffer.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=generator))
    return cache


@pytest.fixture
def push_server():
    """start(caches, on_failed=None) -> PushReceiver served on 127.0.0.1:<port 0>; stopped at teardown."""
    servers = []

    def start(caches, on_failed=None) -> PushReceiver:
        receiver = PushReceiver(caches, on_failed=on_failed)
        server, port = serve(receiver)
        servers.append(server)
        receiver.advertise([f"127.0.0.1:{port}"] * len(caches))
        return receiver

    yield start
    for server in servers:
        server.stop(0).wait()
