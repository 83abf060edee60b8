"""DecodeService over a tiny Kimi K3 (KDA state slots in the shared-memory pool, issue 14 item 3): a
reservation holds a state slot with its pages, and lease expiry, release (abort), a refused transfer and a
client cancel each give the slot back: the free slot count returns to its start value on every path."""
from __future__ import annotations

import asyncio

import pytest

from decode_worker.config import DecodeWorkerConfig
from decode_worker.server import _Receivers
from decode_worker.service import DecodeService
from kvtransfer.destination import TransportKind
from kvtransfer.shm_transport import ShmWriter
from rpc.status import FailedPrecondition, ResourceExhausted
from tests.decode_worker.thread_port import thread_port
from tests.services.decode_hooks import engine_thread_blocked, mark_kv_complete
from tests.services.helpers import eventually, greedy
from tests.services.k3_service_model import make_k3_service_model

PAGE_SIZE = 16


@pytest.fixture(scope="module")
def k3_model(tmp_path_factory):
    return make_k3_service_model(tmp_path_factory.mktemp("k3_slots_model"))


@pytest.fixture
async def service(k3_model):
    receivers = _Receivers()
    config = DecodeWorkerConfig.build(model_dir=str(k3_model), draft_model_dir="", attention_backend="torch",
                                      kv_memory_bytes=2 * 2**20, page_size=PAGE_SIZE, num_threads=1, max_running=3,
                                      lease_ttl_s=0.3, lease_grace_s=0.0, lease_sweep_interval_s=0.02,
                                      admit_timeout_s=0.3)
    decode = DecodeService(config, receivers, port_factory=thread_port(config))  # reached into: an engine thread
    await decode.start()
    receivers.push.advertise(["127.0.0.1:1"] * len(receivers.pools))
    yield decode
    await decode.stop()
    receivers.close()


async def _settled(decode: DecodeService, free_pages: int, free_slots: int) -> None:
    await eventually(lambda: (decode.load.leases, decode.load.free_pages, decode.load.free_state_slots)
                     == (0, free_pages, free_slots), f"no lease, {free_pages} free pages and {free_slots} free slots")


def _start(service: DecodeService) -> tuple[int, int]:
    load = service.load
    assert load.total_state_slots == 4 and load.free_state_slots == 4  # max_running + 1
    return load.free_pages, load.free_state_slots


async def test_a_reservation_holds_a_slot_and_lease_expiry_frees_it(service):
    """Reserve takes a state slot (named in the destination); the sweeper's expiry gives it back."""
    pages, slots = _start(service)
    destination = await service.reserve("e1", 20, 4, TransportKind.SHM)
    assert destination.state_slot is not None and service.load.free_state_slots == slots - 1
    await _settled(service, pages, slots)


@pytest.mark.parametrize("transport", [TransportKind.SHM, TransportKind.GRPC])
async def test_release_frees_the_slot_at_once(service, transport):
    """Release (abort) of an unclaimed lease returns its pages and its state slot."""
    pages, slots = _start(service)
    destination = await service.reserve("a1", 40, 4, transport)
    assert destination.state_slot is not None
    assert await service.release("a1")
    await _settled(service, pages, slots)


async def test_refused_transfer_frees_the_slot(service):
    """A transfer the writer aborted (FAILED completion record) fails Decode with FAILED_PRECONDITION and
    frees pages and slot; so does a Decode whose KV never arrived."""
    pages, slots = _start(service)
    destination = await service.reserve("f1", 20, 4, TransportKind.SHM)
    writer = ShmWriter(service.receivers[TransportKind.SHM].layout)
    try:
        writer.open(destination, 0).abort("refused in a test")
    finally:
        writer.close()
    with pytest.raises(FailedPrecondition):
        async for _ in service.decode("f1", destination.lease_id, [5] * 20, 7, greedy(4)):
            pass
    await _settled(service, pages, slots)
    destination = await service.reserve("f2", 20, 4, TransportKind.GRPC)
    with pytest.raises(FailedPrecondition):
        async for _ in service.decode("f2", destination.lease_id, [5] * 20, 7, greedy(4)):
            pass
    await _settled(service, pages, slots)


async def test_client_cancel_while_waiting_for_kv_frees_the_slot(service):
    """A Decode cancelled while it waits for the KV (the client went away) frees pages and slot."""
    pages, slots = _start(service)
    destination = await service.reserve("c1", 20, 4, TransportKind.SHM)

    async def consume() -> None:
        async for _ in service.decode("c1", destination.lease_id, [5] * 20, 7, greedy(4)):
            pass

    task = asyncio.create_task(consume())
    await eventually(lambda: (held := service.book.get("c1")) is not None and held.claimed, "Decode to claim the lease")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await _settled(service, pages, slots)


async def test_no_free_slot_is_resource_exhausted(service):
    """Once every state slot is leased, Reserve answers RESOURCE_EXHAUSTED and holds nothing more."""
    pages, slots = _start(service)
    for i in range(slots):
        await service.reserve(f"s{i}", 16, 1, TransportKind.SHM)
    held = service.load.free_pages
    with pytest.raises(ResourceExhausted):
        await service.reserve("late", 16, 1, TransportKind.SHM)
    assert service.load.free_pages == held
    for i in range(slots):
        assert await service.release(f"s{i}")
    await _settled(service, pages, slots)


async def test_a_slot_is_reserved_and_released_while_the_engine_thread_is_busy(service):
    """Reserve takes its pages and state slot on the event loop under the engine's pool lock: with the
    engine thread blocked, the slot count drops at once, and Release gives pages and slot back at once."""
    pages, slots = _start(service)
    async with engine_thread_blocked(service) as gate:
        destination = await asyncio.wait_for(service.reserve("b1", 20, 4, TransportKind.SHM), timeout=30)
        assert destination.state_slot is not None and not gate.is_set()
        assert (service.load.free_pages, service.load.free_state_slots) == (pages - 2, slots - 1)
        assert await service.release("b1")
        assert (service.load.free_pages, service.load.free_state_slots, service.load.leases) == (pages, slots, 0)
        assert not gate.is_set()


async def test_a_standing_lease_keeps_its_slot_when_narrowed(service):
    """A standing lease (48 tokens: 3 pages and a state slot) claimed by a 20-token prompt keeps its state
    slot through the narrowing (the KV, state included, is checked against the narrowed destination), the
    request streams to its end, and pages and slot all come back."""
    pages, slots = _start(service)
    destination = await service.reserve("w1", 48, 1, TransportKind.SHM, standing=True)
    assert destination.state_slot is not None and len(destination.page_ids) == 3
    narrowed = destination.narrowed(20, PAGE_SIZE)
    mark_kv_complete(service.engine, narrowed)
    tokens = [t async for update in service.decode("w1", destination.lease_id, [5] * 20, 7, greedy(4))
              for t in update.token_ids]
    assert len(tokens) == 3
    await _settled(service, pages, slots)
