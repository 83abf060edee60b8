"""The device transport over device pools on the CPU: the memfd IPC layer stands in for CUDA / HIP IPC (same
contract: the pool's memory lives in the decode process, prefill maps it by the control segment's name)."""
from __future__ import annotations

import multiprocessing
import os

import pytest
import torch

from kvtransfer.destination import TransportKind
from kvtransfer.device_pool import DEVICE_PREFIX, DevicePagePool, DevicePoolFactory
from kvtransfer.device_transport import DeviceReceiver, DeviceWriter
from kvtransfer.errors import BadChunk, IncompleteTransfer, LayoutMismatch, TransferAborted, UnknownTransfer
from kvtransfer.layout import KVLayout, SegmentKind
from kvtransfer.leases import LeaseTable
from kvtransfer.shm_pool import SHM_DIR
from engine.weights.device_ipc import MemfdIpc
from tests.kvtransfer.conftest import SMALL_WITH_DRAFT, random_cache

CPU = torch.device("cpu")


@pytest.fixture
def pool():
    pool = DevicePagePool.create(SMALL_WITH_DRAFT, 10, 0, "test", CPU, MemfdIpc())
    yield pool
    pool.close()
    pool.unlink()


def _segment(cache, kind: SegmentKind, layer: int) -> torch.Tensor:
    return cache.layer(layer) if kind == SegmentKind.TARGET else cache.draft_layer(layer)


def test_pool_is_named_as_a_device_pool_and_costs_no_host_page_memory(pool):
    """The control segment is a pdserve-kv-dev-* file whose page area is never populated: its resident size
    stays far below the pool's page bytes (the pages live in the device buffer)."""
    assert pool.name.startswith(DEVICE_PREFIX) and os.path.exists(os.path.join(SHM_DIR, pool.name))
    blocks = os.stat(os.path.join(SHM_DIR, pool.name)).st_blocks * 512
    assert blocks < SMALL_WITH_DRAFT.pool_bytes(10) // 4


def test_copy_from_another_device_lands_in_the_reserved_pages(pool):
    """Pages computed elsewhere (another device: here local CPU tensors) are copied into exactly the reserved
    pages of every target and draft layer; other pages keep their bytes; decode admits without a checksum."""
    receiver, writer = DeviceReceiver([pool]), DeviceWriter(SMALL_WITH_DRAFT)
    pool.cache.buffer.view(torch.uint8).fill_(0x5A)
    source = random_cache(SMALL_WITH_DRAFT, 4, seed=1)
    lease = LeaseTable().grant("r", [9, 2, 3, 5], ttl_s=60)
    destination = receiver.expect(lease, 64)
    assert destination.transport == TransportKind.DEVICE and destination.targets == (pool.name,)
    writer.confirm(destination)
    result = writer.push(source, [0, 1, 2, 3], destination)
    assert result.bytes == 4 * SMALL_WITH_DRAFT.bytes_per_page and result.checksum == 0
    assert receiver.admit("r", timeout_s=10).bytes == result.bytes
    for kind, layer in SMALL_WITH_DRAFT.segments():
        received = _segment(pool.cache, kind, layer)[[9, 2, 3, 5]].view(torch.uint8)  # random bits: compare bytes
        assert torch.equal(received, _segment(source, kind, layer)[:4].contiguous().view(torch.uint8))
        assert _segment(pool.cache, kind, layer)[[0, 1, 4, 6, 7, 8]].view(torch.uint8).eq(0x5A).all()
    writer.close()


def test_missing_pages_abort_and_fail_the_request(pool):
    """A copy that skipped a layer is refused by finish() (IncompleteTransfer) and decode sees an aborted
    transfer, never a half-written request."""
    receiver, writer = DeviceReceiver([pool]), DeviceWriter(SMALL_WITH_DRAFT)
    destination = receiver.expect(LeaseTable().grant("r", [1, 2], ttl_s=60), 20)
    handle = writer.open(destination)
    handle.write_pages(SegmentKind.TARGET, 0, 0, torch.zeros(2, 16, 80, dtype=torch.bfloat16))
    with pytest.raises(IncompleteTransfer):
        handle.finish()
    with pytest.raises(TransferAborted):
        receiver.admit("r", timeout_s=10)
    writer.close()


def test_forged_destination_and_wrong_layout_are_refused_before_any_byte(pool):
    """confirm() refuses a destination whose lease the decode side never reserved, and a writer of another
    layout refuses the pool (LayoutMismatch), as on the shm transport."""
    receiver, writer = DeviceReceiver([pool]), DeviceWriter(SMALL_WITH_DRAFT)
    destination = receiver.expect(LeaseTable().grant("r", [1, 2], ttl_s=60), 20)
    from dataclasses import replace

    with pytest.raises((UnknownTransfer, BadChunk)):
        writer.confirm(replace(destination, lease_id="forged"))
    other = KVLayout(num_layers=4, latent_dim=64, rope_dim=16, page_size=16, dtype="float32", draft_layers=2, draft_dim=128)
    with pytest.raises(LayoutMismatch):
        DeviceWriter(other).pool(pool.name)
    with pytest.raises(BadChunk):
        writer.open(replace(destination, transport=TransportKind.SHM))
    receiver.cancel("r")
    writer.close()


def _prefill_process(name: str, destination_wire: bytes, values: torch.Tensor, done) -> None:
    from kvtransfer.destination import Destination
    from rpc.internal.v1 import kv_pb2

    destination = Destination.from_proto(kv_pb2.KVDestination.FromString(destination_wire))
    writer = DeviceWriter(SMALL_WITH_DRAFT)
    writer.confirm(destination)
    handle = writer.open(destination, in_place=True)
    pages = list(destination.page_ids)
    for layer in range(SMALL_WITH_DRAFT.num_layers):
        handle.cache.kv[layer, pages] = values  # the prefill forward writing the mapped pool in place
    handle.finish()
    writer.close()
    done.set()


@pytest.mark.slow
def test_another_process_writes_the_pool_in_place(pool, shm_leak_guard):
    """Across processes: prefill maps decode's pool by name (IPC handle in the control segment) and writes the
    reserved pages through the mapped view; decode admits and its own buffer holds those values (no copy)."""
    receiver = DeviceReceiver([pool])
    destination = receiver.expect(LeaseTable().grant("r", [7, 3], ttl_s=60), 30)
    values = torch.randn(2, 16, 80).to(torch.bfloat16)
    context = multiprocessing.get_context("spawn")
    done = context.Event()
    process = context.Process(target=_prefill_process,
                              args=(pool.name, destination.to_proto().SerializeToString(), values, done))
    process.start()
    shm_leak_guard.track_pid(process.pid)
    try:
        assert done.wait(120), "the prefill process did not finish"
        assert receiver.admit("r", timeout_s=10).bytes == 2 * SMALL_WITH_DRAFT.bytes_per_page
        for layer in range(SMALL_WITH_DRAFT.num_layers):
            assert torch.equal(pool.cache.kv[layer, [7, 3]], values)
    finally:
        process.join(60)
    assert process.exitcode == 0


def test_factory_creates_device_pools_and_attaches_both_kinds():
    """DevicePoolFactory (what the workers hand their engines) creates device pools and attaches a device
    pool or a plain shm pool by name, so a prefill engine can write into either kind."""
    from kvtransfer.shm_pool import SharedPagePool

    factory = DevicePoolFactory("cpu")
    shape = SMALL_WITH_DRAFT.to_cache_shape(4)
    created = factory.create(shape, 4, 0, "test")
    plain = SharedPagePool.create(SMALL_WITH_DRAFT, 4)
    try:
        device_view, shm_view = factory.attach(created.name, shape), factory.attach(plain.name, shape)
        assert isinstance(device_view, DevicePagePool) and isinstance(shm_view, SharedPagePool)
        device_view.cache.kv[0, 1] = 3.0
        assert created.cache.kv[0, 1].eq(3.0).all()
        device_view.close()
        shm_view.close()
    finally:
        created.close()
        created.unlink()
        plain.close()
        plain.unlink()


def test_grpc_push_into_a_device_pool_goes_through_the_host_mirror():
    """StagedPushReceiver (gRPC into a GPU pool): a real Push lands in the host mirror, and only admit() copies
    the request's pages into the device cache (here a CPU cache standing in); other pages stay untouched."""
    from kvtransfer.grpc_servicer import serve
    from kvtransfer.grpc_transport import GrpcWriter
    from kvtransfer.staged_receiver import StagedPushReceiver
    from engine.cache.kv_cache import PagedLatentCache

    device_cache = PagedLatentCache(SMALL_WITH_DRAFT.to_cache_shape(8))
    device_cache.buffer.view(torch.uint8).fill_(0x11)
    receiver = StagedPushReceiver([device_cache])
    server, port = serve(receiver)
    try:
        receiver.advertise([f"127.0.0.1:{port}"])
        source = random_cache(SMALL_WITH_DRAFT, 3, seed=5)
        destination = receiver.expect(LeaseTable().grant("r", [6, 1, 2], ttl_s=60), 40)
        writer = GrpcWriter(SMALL_WITH_DRAFT)
        writer.push(source, [0, 1, 2], destination)
        assert device_cache.buffer.view(torch.uint8).eq(0x11).all(), "nothing reaches the device before admit"
        receiver.admit("r", timeout_s=30)
        for kind, layer in SMALL_WITH_DRAFT.segments():
            received = _segment(device_cache, kind, layer)[[6, 1, 2]].view(torch.uint8)
            assert torch.equal(received, _segment(source, kind, layer)[:3].contiguous().view(torch.uint8))
            assert _segment(device_cache, kind, layer)[[0, 3, 4, 5, 7]].view(torch.uint8).eq(0x11).all()
        writer.close()
    finally:
        server.stop(0).wait()


def test_device_pools_hold_linear_attention_state_slots():
    """A model with linear-attention state (K3) keeps its state slots after the pages of its KV pool; on a GPU the
    decode worker's pool is a device pool, so DevicePoolFactory must create it with those slots (it refused every
    layout with state before: num_state_slots=0) and a prefill engine attaching it sees the same slots."""
    import dataclasses

    from kvtransfer.layout import StateLayout

    state = StateLayout(state_layers=2, conv_width=3, conv_channels=3 * 2 * 4, state_heads=2, head_k_dim=4,
                        head_v_dim=4, conv_dtype="float32", ssm_dtype="float32")
    layout = dataclasses.replace(SMALL_WITH_DRAFT, state=state)
    shape = layout.to_cache_shape(4, num_slots=3)
    factory = DevicePoolFactory("cpu")
    created = factory.create(shape, 4, 0, "test")
    try:
        assert created.cache.state.num_slots == 3
        attached = factory.attach(created.name, shape)
        attached.cache.state.raw[2] = 7
        assert created.cache.state.raw[2].eq(7).all() and created.cache.state.raw[1].eq(0).all()
        attached.close()
    finally:
        created.close()
        created.unlink()
