"""Device transport: the shm protocol (lease-bound completion slots in the control segment, checked before
the first byte; a completion record per rank after the last) over device pools (kvtransfer.device_pool).

Writer (prefill): on the pool's own device the prefill engine runs its forward straight into the pages
(open(..., in_place=True), then finish()); from another device of the node (or from the CPU) the pages it
computed locally are copied into the IPC-mapped pool with write_pages / push (a peer copy, no host hop).
finish() waits for the device work to land before the record is written. The records carry no checksum:
hashing device memory on the host would cost the copy this transport exists to avoid (the shm transport
checks bytes; both check layout, lease, slot, sequence, byte and token counts).
Reader (decode): DeviceReceiver, the ShmReceiver over the control segments without the checksum."""
from __future__ import annotations

import torch

from kvtransfer.device_pool import DevicePagePool, current_device
from kvtransfer.destination import Destination, TransportKind
from kvtransfer.errors import BadChunk
from kvtransfer.layout import KVLayout, SegmentKind
from kvtransfer.page_spans import page_runs
from kvtransfer.shm_receiver import ShmReceiver
from kvtransfer.shm_transport import ShmWriteHandle, ShmWriter
from engine.weights.device_ipc import ipc_for


class DeviceWriteHandle(ShmWriteHandle):
    """One request on one rank of a device pool; `cache` is the IPC-mapped PagedLatentCache."""

    host_only = False

    def write_pages(self, kind: SegmentKind, layer: int, first_index: int, data: torch.Tensor) -> None:
        """data [n, page_size, row_dim] on any device: copied into the pool's device (peer copy between GPUs)."""
        self.destination.check_lease()
        self.check_data(kind, layer, first_index, data)
        if kind == SegmentKind.STATE:
            raise BadChunk("the device transport does not carry linear-attention (KDA) state yet")
        count = data.shape[0]
        target = self.cache.layer(layer) if kind == SegmentKind.TARGET else self.cache.draft_layer(layer)
        for index, first_page, run in page_runs(self.destination.page_ids[first_index : first_index + count]):
            target[first_page : first_page + run].copy_(data[index : index + run], non_blocking=True)
        self._written[self._segments[(kind, layer)]][first_index : first_index + count] = True

    def _checksum(self) -> tuple[int, int]:
        buffer = self.cache.buffer
        if buffer.is_cuda:
            torch.cuda.synchronize(buffer.device)  # the pages are written before the record says so
        return 0, sum(len(units) * self.layout.page_bytes(kind) for (kind, _), units in zip(self._segments, self._units))


class DeviceWriter(ShmWriter):
    """Prefill side of the device transport: attaches device pools by name (IPC, once each)."""

    transport = TransportKind.DEVICE

    def __init__(self, layout: KVLayout, device_type: str = "cpu") -> None:
        super().__init__(layout)
        self.device_type = device_type

    def _attach(self, name: str) -> DevicePagePool:
        device = current_device(self.device_type)
        return DevicePagePool.attach(name, self.layout, device, ipc_for(device))

    def open(self, destination: Destination, rank: int = 0, in_place: bool = False) -> DeviceWriteHandle:
        pool = self._checked_pool(destination, rank)
        return DeviceWriteHandle(pool, destination, rank, self.algorithm, in_place)


class DeviceReceiver(ShmReceiver):
    """Decode side: ShmReceiver over the device pools' control segments, no page checksum (see above)."""

    transport = TransportKind.DEVICE

    def __init__(self, pools, **options) -> None:
        super().__init__(pools, verify_checksum=False, **options)
