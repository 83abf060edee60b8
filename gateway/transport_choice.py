"""Which KV transport a request uses, from where its prefill and decode workers are (`--transport auto`),
or the one forced by --transport. Pure: tested without workers.

    same node, decode pool on a device (CUDA / HIP IPC)   -> device (in place on the pool's own device,
                                                              a peer copy from another device of the node)
    same node, decode pool in CPU shared memory:
        prefill on the CPU                                -> shm (in place)
        prefill on a GPU                                  -> grpc (its pages are staged through pinned memory)
    different nodes, or a worker not yet polled           -> grpc

The gateway picks the prefill worker after Reserve (by load, as before), so it passes the placement all its
reachable prefill workers share; prefill workers in different places make that None, hence grpc.
"""
from __future__ import annotations

from dataclasses import dataclass

TRANSPORT_NAMES = ("auto", "shm", "grpc", "device")


@dataclass(frozen=True)
class Placement:
    """Where a worker runs, as its load answer says. device: the prefill engine's ("cpu" | "cuda");
    kv_pool: the decode pool's ("shm" | "device"); empty when the worker did not say (older worker)."""

    node_id: str = ""
    device: str = ""
    kv_pool: str = ""


def choose_transport(requested: str, prefill: Placement | None, decode: Placement | None) -> str:
    """"shm" | "grpc" | "device" for one request (requested: one of TRANSPORT_NAMES)."""
    if requested not in TRANSPORT_NAMES:
        raise ValueError(f"transport must be one of {TRANSPORT_NAMES}, got {requested!r}")
    if requested != "auto":
        return requested
    if prefill is None or decode is None or not prefill.node_id or prefill.node_id != decode.node_id:
        return "grpc"
    if decode.kv_pool == "device":
        return "device"
    if decode.kv_pool == "shm" and prefill.device in ("", "cpu"):
        return "shm"
    return "grpc"
