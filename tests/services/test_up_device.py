"""`pdserve up --device cuda` is accepted now that the decode pool can live on the device; only the pairings a
GPU decode pool cannot serve are refused, before any process starts (GPU count patched: no GPU needed)."""
from __future__ import annotations


import pytest

from engine.runtime import devices
from pdserve.commands import up
from pdserve.launcher import kv_pool_flags
from tests.services.helpers import up_args


@pytest.fixture
def two_gpus(monkeypatch):
    monkeypatch.setattr(devices, "gpu_count", lambda: 2)


@pytest.mark.parametrize("transport", ["auto", "device", "grpc"])
def test_cuda_is_accepted_with_transports_a_device_pool_serves(two_gpus, transport):
    """auto / device / grpc (staged into the device pool) pass the start-up checks on a 2-GPU node."""
    up._check_device(up_args(device="cuda", transport=transport, prefill_tp=2, decode_tp=2))


def test_cuda_with_shm_is_refused_naming_the_alternatives(two_gpus):
    """--transport shm keeps pages in CPU shared memory, which a GPU decode pool is not: a ValueError that
    names the transports that work."""
    with pytest.raises(ValueError, match="auto, device or grpc"):
        up._check_device(up_args(device="cuda", transport="shm"))


def test_more_ranks_than_gpus_is_still_refused(two_gpus):
    """The GPU count check still runs first: TP=4 on a 2-GPU node fails naming the missing GPU."""
    with pytest.raises(ValueError, match="only 2 GPU"):
        up._check_device(up_args(device="cuda", transport="auto", prefill_tp=4))


def test_forced_transports_set_the_decode_pool_kind():
    """--transport shm / device pin the decode workers' --kv-pool; auto and grpc leave it to the worker."""
    assert kv_pool_flags("shm") == ("--kv-pool", "shm")
    assert kv_pool_flags("device") == ("--kv-pool", "device")
    assert kv_pool_flags("auto") == () and kv_pool_flags("grpc") == ()
