"""Where device-transport work happens, decided without a GPU: which device a decode rank's pool goes on,
when a prefill rank writes a device pool in place, and the no-GPU fallbacks."""
from __future__ import annotations

import torch

from kvtransfer.device_pool import DevicePoolFactory
from prefill_worker.kv_export import rank_device_ids, stage_to_host, writes_in_place


def test_decode_rank_pools_follow_the_gpu_list():
    """Rank r's device pool is created on cuda:gpus[r] (cuda:r without a list); on the CPU always the CPU."""
    assert DevicePoolFactory("cuda", (3, 5))._device(1) == torch.device("cuda", 5)
    assert DevicePoolFactory("cuda")._device(2) == torch.device("cuda", 2)
    assert DevicePoolFactory("cpu", (3, 5))._device(1) == torch.device("cpu")


def test_in_place_only_when_every_rank_shares_its_pools_device():
    """In place needs each prefill rank on the very device of the pool it writes; one rank elsewhere (or an
    unknown device id) means compute locally and copy device to device."""
    assert writes_in_place(["cuda:A", "cuda:B"], ["cuda:A", "cuda:B"])
    assert not writes_in_place(["cuda:A", "cuda:B"], ["cuda:A", "cuda:C"])
    assert not writes_in_place(["cuda:A"], [""])
    assert not writes_in_place(["cuda:A", "cuda:A"], ["cuda:A"])


def test_rank_device_ids_on_cpu_and_without_a_gpu():
    """CPU ranks all name the node's CPU (the memfd stand-in writes in place); cuda ranks on a machine without
    a GPU get empty ids (never in place), not an exception."""
    cpu = rank_device_ids("cpu", (), 2)
    assert len(cpu) == 2 and cpu[0] == cpu[1] and cpu[0].startswith("cpu:")
    if not torch.cuda.is_available():
        assert rank_device_ids("cuda", (0, 1), 2) == ("", "")


def test_host_pages_are_passed_through_unstaged():
    """stage_to_host leaves CPU pages (and a missing draft) as they are: only device pages are copied."""
    target = torch.ones(2, 3)
    staged_target, staged_draft = stage_to_host((target, None))
    assert staged_target is target and staged_draft is None
