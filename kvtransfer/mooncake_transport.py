"""Optional multi-node RDMA transport over mooncake-transfer-engine (pip install 'pdserve[mooncake]').

Same pages and completion record as the shm transport, moved by one-sided RDMA writes instead of a local
memcpy. Decode registers each rank's whole pool segment (header, completion slots, pages) with its
TransferEngine and publishes, per rank, its session id ("host:rpc_port") and the remote addresses of the
page data and of the request's completion slot (Destination.data_addresses / record_addresses). Prefill
writes the pages with batch_transfer_sync_write, then the completion record with transfer_sync_write;
decode verifies exactly as for shm (ShmReceiver: sequence, keys, bytes, tokens, checksum of the pages).

API used (mooncake.engine.TransferEngine): initialize(local_hostname, metadata_server, protocol,
device_name) -> 0 | error, get_rpc_port(), register_memory(addr, length), unregister_memory(addr),
transfer_sync_write(target, local_addr, remote_addr, length), batch_transfer_sync_write(target,
local_addrs, remote_addrs, lengths); each returns 0 on success.
"""
from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvtransfer.checksum import DEFAULT_ALGORITHM, Algorithm, Hasher, combine
from kvtransfer.completion import SLOT_BYTES, CompletionRecord, SlotState, key_of
from kvtransfer.destination import Destination, TransportKind, now_ms
from kvtransfer.errors import BadChunk, IncompleteTransfer, KVTransferError, TransportUnavailable
from kvtransfer.layout import KVLayout, SegmentKind
from kvtransfer.page_spans import byte_view, page_offset, page_runs
from kvtransfer.shm_pool import SharedPagePool
from kvtransfer.shm_receiver import ShmReceiver
from kvtransfer.transport import KVWriteHandle, KVWriter, TransferResult


@dataclass(frozen=True)
class MooncakeConfig:
    local_hostname: str  # address peers reach this engine at, e.g. "10.0.0.5"
    metadata_server: str = "P2PHANDSHAKE"  # or an etcd address
    protocol: str = "rdma"  # "rdma" or "tcp"
    device_name: str = ""  # RDMA NICs to use; "" = auto

    def __post_init__(self) -> None:
        if not self.local_hostname or not self.metadata_server or not self.protocol:
            raise ValueError("MooncakeConfig needs a hostname, a metadata server and a protocol")


def start_engine(config: MooncakeConfig, engine=None):
    """An initialized TransferEngine (engine: an object with the same API, e.g. a test fake)."""
    if engine is None:
        try:
            from mooncake.engine import TransferEngine
        except ImportError as error:
            raise TransportUnavailable(
                "the mooncake transport needs mooncake-transfer-engine (pip install 'pdserve[mooncake]')"
            ) from error
        engine = TransferEngine()
    _check(engine.initialize(config.local_hostname, config.metadata_server, config.protocol, config.device_name),
           "initialize")
    return engine


def _check(code: int, what: str) -> None:
    if code != 0:
        raise KVTransferError(f"mooncake {what} failed with code {code}")


class MooncakeReceiver(ShmReceiver):
    """Decode side: registers every local pool with the engine; destinations carry session + addresses."""

    transport = TransportKind.MOONCAKE

    def __init__(self, pools: Sequence[SharedPagePool], engine, hostname: str, **kwargs) -> None:
        super().__init__(pools, **kwargs)
        if self.layout.has_state:
            raise ValueError("the mooncake transport does not carry linear-attention state yet (use shm or grpc)")
        self.engine = engine
        self.session = f"{hostname}:{engine.get_rpc_port()}"
        for pool in self.pools:
            _check(engine.register_memory(pool.base_address, pool.mapping_bytes), f"register_memory({pool.name})")

    def _destination_extras(self, slot: int) -> dict:
        return {
            "targets": (self.session,) * len(self.pools),
            "data_addresses": tuple(pool.data_address for pool in self.pools),
            "record_addresses": tuple(pool.record_address(slot) for pool in self.pools),
        }

    def close(self) -> None:
        for pool in self.pools:
            self.engine.unregister_memory(pool.base_address)


class MooncakeWriteHandle(KVWriteHandle):
    """Pages go through the writer's registered staging buffer; each layer must arrive in page order."""

    def __init__(self, writer: MooncakeWriter, destination: Destination, rank: int) -> None:
        super().__init__(destination, rank, writer.layout)
        if writer.layout.has_state:
            raise BadChunk("the mooncake transport does not carry linear-attention state yet (use shm or grpc)")
        self.writer = writer
        self._segments = {segment: i for i, segment in enumerate(writer.layout.segments())}
        self._hashers = [Hasher(writer.algorithm) for _ in self._segments]
        self._next_index = [0] * len(self._segments)

    def remote(self, kind: SegmentKind, layer: int, page: int) -> int:
        dest = self.destination
        return dest.data_addresses[self.rank] + page_offset(self.layout, dest.pool_num_pages, kind, layer, page)

    def write_pages(self, kind: SegmentKind, layer: int, first_index: int, data: torch.Tensor) -> None:
        self.destination.check_lease()
        self.check_data(kind, layer, first_index, data)
        segment = self._segments[(kind, layer)]
        if first_index != self._next_index[segment]:
            raise BadChunk(f"mooncake writes must arrive in page order: layer {layer} expects page index "
                           f"{self._next_index[segment]}, got {first_index}")
        page_bytes = self.layout.page_bytes(kind)
        pages = self.destination.page_ids[first_index : first_index + data.shape[0]]
        source = byte_view(data.contiguous())
        self._hashers[segment].update(source)
        per_batch = max(1, self.writer.staging_bytes // page_bytes)
        for start in range(0, len(pages), per_batch):
            batch = pages[start : start + per_batch]
            self.writer.send(self.destination.target(self.rank), source[start * page_bytes : (start + len(batch)) * page_bytes],
                             [(index * page_bytes, self.remote(kind, layer, first), count * page_bytes)
                              for index, first, count in page_runs(batch)])
        self._next_index[segment] += len(pages)

    def finish(self) -> TransferResult:
        count = len(self.destination.page_ids)
        missing = [segment for segment, done in zip(self.layout.segments(), self._next_index) if done != count]
        if missing:
            self.abort("incomplete")
            raise IncompleteTransfer(f"request {self.destination.request_id}: layers {missing} incomplete")
        checksum = combine([hasher.intdigest() for hasher in self._hashers], self.writer.algorithm)
        nbytes = count * self.layout.bytes_per_page
        self._write_record(SlotState.COMPLETE, nbytes, checksum)
        self.done = True
        return TransferResult(self.destination.request_id, nbytes, checksum)

    def abort(self, reason: str) -> None:
        if not self.done:
            self.done = True
            try:
                self._write_record(SlotState.FAILED, 0, 0)
            except KVTransferError:
                pass  # decode will time the request out

    def _write_record(self, state: SlotState, nbytes: int, checksum: int) -> None:
        dest = self.destination
        record = CompletionRecord(
            state, dest.completion_sequence, int(self.writer.algorithm), nbytes, checksum, dest.num_tokens, now_ms(),
            self.layout.hash, key_of(dest.request_id), key_of(dest.binding),
        )
        self.writer.send_record(dest.target(self.rank), record.pack(), dest.record_addresses[self.rank])


class MooncakeWriter(KVWriter):
    """Prefill side. One registered staging buffer (pages are copied into it, then RDMA-written)."""

    def __init__(self, layout: KVLayout, engine, *, staging_bytes: int = 8 << 20,
                 algorithm: Algorithm = DEFAULT_ALGORITHM) -> None:
        if staging_bytes < max(layout.page_bytes(kind) for kind in SegmentKind) or staging_bytes < SLOT_BYTES:
            raise ValueError("staging buffer must hold at least one page")
        self.layout = layout
        self.engine = engine
        self.algorithm = Algorithm(algorithm)
        self.staging_bytes = staging_bytes
        self._staging = torch.empty(staging_bytes, dtype=torch.uint8)
        self._view = byte_view(self._staging)
        self._lock = threading.Lock()
        _check(engine.register_memory(self._staging.data_ptr(), staging_bytes), "register_memory(staging)")

    def open(self, destination: Destination, rank: int = 0) -> MooncakeWriteHandle:
        if destination.transport != TransportKind.MOONCAKE:
            raise BadChunk(f"MooncakeWriter cannot write a {destination.transport.name} destination")
        destination.check_against(self.layout, f"mooncake writer for request {destination.request_id}")
        destination.check_lease()
        if not destination.pool_num_pages or max(destination.page_ids) >= destination.pool_num_pages:
            raise BadChunk("mooncake destination lacks the pool size or names pages outside it")
        return MooncakeWriteHandle(self, destination, rank)

    def send(self, target: str, payload: memoryview, pieces: list[tuple[int, int, int]]) -> None:
        """Copies payload into staging and writes pieces (payload offset, remote address, length)."""
        with self._lock:
            self._view[: len(payload)] = payload
            base = self._staging.data_ptr()
            _check(self.engine.batch_transfer_sync_write(
                target, [base + offset for offset, _, _ in pieces], [remote for _, remote, _ in pieces],
                [length for _, _, length in pieces],
            ), "batch_transfer_sync_write")

    def send_record(self, target: str, record: bytes, remote: int) -> None:
        with self._lock:
            self._view[: len(record)] = record
            _check(self.engine.transfer_sync_write(target, self._staging.data_ptr(), remote, len(record)),
                   "transfer_sync_write(record)")

    def close(self) -> None:
        self.engine.unregister_memory(self._staging.data_ptr())
