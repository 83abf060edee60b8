"""Getting a prefilled prompt's KV to its destination, after engine.prefill ran.

shm / device on the pool's device: the engine already wrote the pages in place into the decode pools
      (pool_names); here we only make every decode rank's pool hold them (copying when decode has more TP
      ranks than prefill) and write each rank's completion record (checksum over the pages for shm and, for
      linear attention, the state slot the engine ran the prompt's KDA state in).
device from another device: the engine wrote into its own local pages; they are copied device to device
      into every decode rank's IPC-mapped pool.
grpc: the engine wrote into its own local pages; their copies (staged through pinned host memory when they
      live on a GPU) are streamed to every decode rank."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.weights.device_ipc import IpcUnavailable, ipc_for
from engine.runtime.devices import rank_device
from kvtransfer.destination import Destination
from kvtransfer.errors import LayoutMismatch
from kvtransfer.layout import SegmentKind
from kvtransfer.shm_transport import ShmWriter
from kvtransfer.transport import KVWriter


def prefill_pool_names(destination: Destination, prefill_tp: int) -> tuple[str, ...]:
    """The pool each prefill rank writes: decode rank r's for r < decode TP; extra prefill ranks
    rewrite a decode rank's pool with the same (replicated MLA latent) bytes."""
    targets = destination.targets
    return tuple(targets[rank % len(targets)] for rank in range(prefill_tp))


def finish_shm(writer: ShmWriter, destination: Destination, prefill_tp: int) -> int:
    """Completes an in-place write on every decode rank (shm, or device: a DeviceWriter); returns bytes covered."""
    if writer.layout.has_state and prefill_tp != destination.num_ranks:  # (the layout hashes differ too)
        raise LayoutMismatch(f"linear-attention state is sharded: prefill TP {prefill_tp} cannot hand it to "
                             f"decode TP {destination.num_ranks}")
    total = 0
    for rank in range(destination.num_ranks):
        if rank < prefill_tp:
            handle = writer.open(destination, rank, in_place=True)
        else:  # a decode rank no prefill rank wrote: copy rank 0's pages into it
            source = writer.pool(destination.target(0)).cache
            handle = writer.open(destination, rank)
            pages = torch.tensor(destination.page_ids, dtype=torch.int64)
            for kind, layer in handle.layout.segments():
                data = source.layer(layer) if kind == SegmentKind.TARGET else source.draft_layer(layer)
                handle.write_pages(kind, layer, 0, data.index_select(0, pages.to(data.device)))
        total += handle.finish().bytes
    return total


def push_pages(writer: KVWriter, destination: Destination, target: torch.Tensor, draft: torch.Tensor | None,
               states: torch.Tensor | None = None) -> int:
    """Sends page copies to every decode rank. target: [layers, pages, page_size, D];
    draft: [draft_layers, pages, page_size, Dd] or None; states (linear attention): uint8 [prefill TP,
    slot bytes], row r to decode rank r. Returns bytes sent."""
    if writer.layout.has_state and (states is None or states.shape[0] != destination.num_ranks):
        raise LayoutMismatch(f"linear-attention state is sharded: {0 if states is None else states.shape[0]} "
                             f"prefill ranks cannot hand it to decode TP {destination.num_ranks}")
    total = 0
    for rank in range(destination.num_ranks):
        with writer.open(destination, rank) as handle:
            for kind, layer in handle.layout.segments():
                if kind == SegmentKind.STATE:
                    data = states[rank : rank + 1]  # type: ignore[index]
                else:
                    data = target[layer] if kind == SegmentKind.TARGET else draft[layer]  # type: ignore[index]
                handle.write_pages(kind, layer, 0, data.contiguous())
            total += handle.finish().bytes
    return total


def writes_in_place(pool_device_ids: Sequence[str], rank_device_ids: Sequence[str]) -> bool:
    """Device transport: prefill rank r runs its forward straight into the pool it writes (pool_device_ids[r])
    only when both are one device, for every rank; otherwise the pages are computed locally and copied."""
    return len(pool_device_ids) == len(rank_device_ids) and all(
        local and pool == local for pool, local in zip(pool_device_ids, rank_device_ids))


def rank_device_ids(device: str, gpus: Sequence[int], tp_size: int) -> tuple[str, ...]:
    """The device id (engine.weights.device_ipc naming) of each prefill rank: equal to a pool's id means in place."""
    ipc = ipc_for(device)
    try:
        return tuple(ipc.device_id(rank_device(device, gpus or tuple(range(tp_size)), rank)) for rank in range(tp_size))
    except IpcUnavailable:
        return ("",) * tp_size  # no usable IPC layer here: never in place, device destinations get copies


def stage_to_host(pages: tuple[torch.Tensor, torch.Tensor | None]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Page copies on the host for a gRPC push: device tensors go through pinned memory (one D2H copy each)."""
    def host(tensor: torch.Tensor | None) -> torch.Tensor | None:
        if tensor is None or tensor.device.type == "cpu":
            return tensor
        staged = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        return staged.copy_(tensor)

    return host(pages[0]), host(pages[1])
