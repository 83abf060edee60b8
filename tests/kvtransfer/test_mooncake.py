"""Mooncake adapter against a fake TransferEngine that moves real bytes (ctypes.memmove) between registered
regions of one process: pages and the completion record land where decode's ShmReceiver verifies them."""
from __future__ import annotations

import ctypes
import sys

import pytest
import torch

from kvtransfer.destination import Destination
from kvtransfer.errors import BadChunk, ChecksumMismatch, KVTransferError, TransportUnavailable
from kvtransfer.layout import SegmentKind
from kvtransfer.leases import LeaseTable
from kvtransfer.mooncake_transport import MooncakeConfig, MooncakeReceiver, MooncakeWriter, start_engine
from kvtransfer.shm_pool import SharedPagePool
from rpc.internal.v1 import kv_pb2

from .conftest import SMALL_WITH_DRAFT, random_cache

LAYOUT = SMALL_WITH_DRAFT


class FakeEngine:
    """The subset of mooncake.engine.TransferEngine the adapter uses; engines find each other by session."""

    network: dict[str, FakeEngine] = {}

    def __init__(self, port: int) -> None:
        self.port = port
        self.regions: dict[int, int] = {}
        self.calls: list[str] = []

    def initialize(self, local_hostname, metadata_server, protocol, device_name) -> int:
        self.hostname = local_hostname
        FakeEngine.network[f"{local_hostname}:{self.port}"] = self
        return 0

    def get_rpc_port(self) -> int:
        return self.port

    def register_memory(self, address: int, length: int) -> int:
        self.regions[address] = length
        return 0

    def unregister_memory(self, address: int) -> int:
        return 0 if self.regions.pop(address, None) is not None else -1

    def _inside(self, address: int, length: int) -> bool:
        return any(start <= address and address + length <= start + size for start, size in self.regions.items())

    def transfer_sync_write(self, target: str, buffer: int, peer_address: int, length: int) -> int:
        self.calls.append("write")
        peer = FakeEngine.network.get(target)
        if peer is None or not self._inside(buffer, length) or not peer._inside(peer_address, length):
            return -1
        ctypes.memmove(peer_address, buffer, length)
        return 0

    def batch_transfer_sync_write(self, target, buffers, peer_addresses, lengths) -> int:
        self.calls.append("batch")
        for buffer, peer, length in zip(buffers, peer_addresses, lengths):
            if self.transfer_sync_write(target, buffer, peer, length) != 0:
                return -1
        return 0


@pytest.fixture
def link():
    FakeEngine.network.clear()
    decode_engine = start_engine(MooncakeConfig("10.0.0.2", protocol="tcp"), FakeEngine(17001))
    prefill_engine = start_engine(MooncakeConfig("10.0.0.1", protocol="tcp"), FakeEngine(17002))
    pools = [SharedPagePool.create(LAYOUT, 10, rank) for rank in range(2)]
    receiver = MooncakeReceiver(pools, decode_engine, "10.0.0.2")
    writer = MooncakeWriter(LAYOUT, prefill_engine, staging_bytes=8192)
    yield pools, receiver, writer, prefill_engine
    writer.close()
    receiver.close()
    for pool in pools:
        pool.close()
        pool.unlink()


def test_pages_and_record_arrive_and_verify(link):
    """Two ranks pushed through the fake RDMA engine: decode admits (record + checksum) and the bytes match;
    the batches are small (staging of 8 KiB) so many batched writes are exercised."""
    pools, receiver, writer, engine = link
    source = random_cache(LAYOUT, 5, seed=12)
    destination = receiver.expect(LeaseTable().grant("r", [8, 2, 3, 0], 60), 60)
    destination = Destination.from_proto(kv_pb2.KVDestination.FromString(destination.to_proto().SerializeToString()))
    assert destination.targets == ("10.0.0.2:17001",) * 2 and len(destination.record_addresses) == 2
    for rank in range(2):
        writer.push(source, [4, 1, 2, 3], destination, rank)
    assert receiver.admit("r").bytes == 2 * 4 * LAYOUT.bytes_per_page
    for pool in pools:
        assert torch.equal(pool.cache.kv[:, [8, 2, 3, 0]].view(torch.uint8), source.kv[:, [4, 1, 2, 3]].view(torch.uint8))
        assert torch.equal(pool.cache.draft[:, [8, 2, 3, 0]].view(torch.uint8), source.draft[:, [4, 1, 2, 3]].view(torch.uint8))
    assert engine.calls.count("batch") > 2 * len(LAYOUT.segments())


def test_corruption_after_transfer_is_caught_by_decode(link):
    """A bit changed in decode's pool after the RDMA write fails the checksum at admit."""
    pools, receiver, writer, engine = link
    destination = receiver.expect(LeaseTable().grant("r", [5], 60), 3)
    for rank in range(2):
        writer.push(random_cache(LAYOUT, 1, seed=13), [0], destination, rank)
    pools[1].cache.kv[2, 5].view(torch.uint8)[0, 0] ^= 4
    with pytest.raises(ChecksumMismatch, match="rank 1"):
        receiver.admit("r")


def test_out_of_order_pages_and_engine_errors_are_reported(link):
    """Pages must come in order per layer (the checksum is streamed); a failed engine call raises."""
    pools, receiver, writer, engine = link
    destination = receiver.expect(LeaseTable().grant("r", [1, 2], 60), 20)
    handle = writer.open(destination)
    with pytest.raises(BadChunk, match="page order"):
        handle.write_pages(SegmentKind.TARGET, 0, 1, torch.zeros(1, 16, 80, dtype=torch.bfloat16))
    engine.regions.clear()  # the staging buffer is no longer registered: the write fails
    with pytest.raises(KVTransferError, match="batch_transfer_sync_write"):
        handle.write_pages(SegmentKind.TARGET, 0, 0, torch.zeros(1, 16, 80, dtype=torch.bfloat16))


def test_missing_package_is_a_clear_error(monkeypatch):
    """Without mooncake-transfer-engine installed, start_engine says what to install."""
    monkeypatch.setitem(sys.modules, "mooncake", None)
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)
    with pytest.raises(TransportUnavailable, match="mooncake-transfer-engine"):
        start_engine(MooncakeConfig("10.0.0.1"))
