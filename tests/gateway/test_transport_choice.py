"""`--transport auto`: the KV transport of each request follows from where its two workers are."""
from __future__ import annotations

import pytest

from gateway.transport_choice import Placement, choose_transport

NODE_A, NODE_B = "boot-a", "boot-b"


@pytest.mark.parametrize(
    ("prefill", "decode", "expected"),
    [
        (Placement(NODE_A, device="cpu"), Placement(NODE_A, kv_pool="shm"), "shm"),
        (Placement(NODE_A, device="cuda"), Placement(NODE_A, kv_pool="device"), "device"),
        (Placement(NODE_A, device="cpu"), Placement(NODE_A, kv_pool="device"), "device"),
        (Placement(NODE_A, device="cuda"), Placement(NODE_A, kv_pool="shm"), "grpc"),
        (Placement(NODE_A, device="cuda"), Placement(NODE_B, kv_pool="device"), "grpc"),
        (Placement(NODE_A, device="cpu"), Placement(NODE_B, kv_pool="shm"), "grpc"),
        (Placement("", device="cpu"), Placement("", kv_pool="shm"), "grpc"),
        (None, Placement(NODE_A, kv_pool="shm"), "grpc"),
        (Placement(NODE_A, device="cpu"), None, "grpc"),
    ],
    ids=["same-node-cpu", "same-node-gpu", "cpu-prefill-to-gpu-pool", "gpu-prefill-to-cpu-pool",
         "other-node-gpu", "other-node-cpu", "node-unknown", "prefill-not-polled", "decode-not-polled"],
)
def test_auto_picks_from_both_ends(prefill, decode, expected):
    """Same node: device when decode's pool is on a device, shm when both are CPU; otherwise (another node,
    a GPU prefill with a CPU pool, or a placement not known yet) grpc, which works everywhere."""
    assert choose_transport("auto", prefill, decode) == expected


@pytest.mark.parametrize("forced", ["shm", "grpc", "device"])
def test_forced_transport_is_kept(forced):
    """--transport shm / grpc / device is used as given, whatever the placements say."""
    assert choose_transport(forced, Placement(NODE_A, device="cpu"), Placement(NODE_B, kv_pool="shm")) == forced


def test_unknown_transport_is_refused():
    """A transport name that does not exist is a ValueError naming the choices."""
    with pytest.raises(ValueError, match="transport must be one of"):
        choose_transport("rdma", None, None)
