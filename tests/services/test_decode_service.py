"""DecodeService without gRPC, over a real tiny engine with a shared-memory pool: leases, admission and release."""
from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator

import pytest

from decode_worker.admission import growth_pages
from decode_worker.config import DecodeWorkerConfig
from decode_worker.server import _Receivers
from decode_worker.service import DecodeService
from kvtransfer.destination import TransportKind
from rpc.status import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from tests.decode_worker.thread_port import thread_port
from tests.services.decode_hooks import engine_thread_blocked, mark_kv_complete
from tests.services.helpers import eventually, greedy

PAGE_SIZE = 16


@contextlib.asynccontextmanager
async def _running_service(service_model, lease_ttl_s: float) -> AsyncIterator[DecodeService]:
    receivers = _Receivers()
    config = DecodeWorkerConfig.build(model_dir=str(service_model), draft_model_dir="", attention_backend="torch",
                                      kv_memory_bytes=96 * 1024, page_size=PAGE_SIZE, num_threads=1,
                                      lease_ttl_s=lease_ttl_s, lease_grace_s=0.0, lease_sweep_interval_s=0.02,
                                      admit_timeout_s=0.2)
    decode = DecodeService(config, receivers, port_factory=thread_port(config))  # reached into: an engine thread
    await decode.start()
    receivers.push.advertise(["127.0.0.1:1"] * len(receivers.pools))  # no pushes here; expect() needs an address
    try:
        yield decode
    finally:
        await decode.stop()
        receivers.close()


@pytest.fixture
async def service(service_model):
    async with _running_service(service_model, lease_ttl_s=0.3) as decode:
        yield decode


async def _settled(decode: DecodeService, free_pages: int) -> None:
    """Waits (failing loudly) until no lease is held and `free_pages` pages are free (leases that expire
    go with the sweeper's next pass)."""
    await eventually(lambda: decode.load.leases == 0 and decode.load.free_pages == free_pages,
                     f"no lease and {free_pages} free pages")


async def test_unclaimed_lease_expires_and_frees_its_pages(service):
    """A reservation nobody claims is freed by the sweeper after its deadline; claiming it then fails."""
    total = service.load.free_pages
    destination = await service.reserve("r1", 40, 8, TransportKind.SHM)
    assert len(destination.page_ids) == 3 and service.load.free_pages == total - 3
    assert destination.lease_deadline_unix_ms > 0 and destination.completion_slot >= 0
    await _settled(service, total)  # only the sweeper can drop an unclaimed lease
    assert service.load.free_pages == total and service.load.leases == 0
    with pytest.raises(NotFound):
        async for _ in service.decode("r1", destination.lease_id, [5] * 40, 7, greedy(8)):
            pass


async def test_release_frees_an_unclaimed_lease_at_once(service):
    """Release of a reservation returns its pages immediately and is idempotent."""
    total = service.load.free_pages
    await service.reserve("r2", 17, 4, TransportKind.GRPC)
    assert service.load.free_pages == total - 2
    assert await service.release("r2")
    await _settled(service, total)
    assert service.load.free_pages == total
    assert not await service.release("r2")


async def test_admission_refuses_what_does_not_fit(service):
    """A request that can never fit is INVALID_ARGUMENT; one that does not fit now is RESOURCE_EXHAUSTED;
    a second reservation under the same id is refused."""
    total = service.load.total_pages
    with pytest.raises(InvalidArgument):
        await service.reserve("big", total * PAGE_SIZE, 8, TransportKind.SHM)
    held = [await service.reserve(f"fill{i}", PAGE_SIZE * 3, 1, TransportKind.SHM) for i in range(total // 3)]
    with pytest.raises(ResourceExhausted):
        await service.reserve("late", PAGE_SIZE * 3, 1, TransportKind.SHM)
    with pytest.raises(Exception, match="already"):
        await service.reserve("fill0", 10, 1, TransportKind.SHM)
    for i in range(len(held)):
        await service.release(f"fill{i}")
    await _settled(service, total)
    assert service.load.free_pages == total


async def test_decode_without_kv_fails_and_frees(service):
    """Decode of a lease whose KV never arrived fails (no completion record) and its pages return."""
    total = service.load.free_pages
    destination = await service.reserve("r3", 20, 4, TransportKind.SHM)
    with pytest.raises(FailedPrecondition):
        async for _ in service.decode("r3", destination.lease_id, [5] * 20, 7, greedy(4)):
            pass
    await _settled(service, total)
    assert service.load.free_pages == total


@pytest.mark.parametrize("how", ["release", "abandon"])
async def test_reserve_is_answered_while_the_engine_thread_is_busy(service, how):
    """Reserve allocates on the event loop under the engine's pool lock: it is answered while the engine
    thread is blocked (as in a long step), and Release or a lost answer (abandon) gives the pages back at
    once, still without the engine thread: nothing stays allocated and no lease is left."""
    total = service.engine.num_free_pages
    async with engine_thread_blocked(service) as gate:
        destination = await asyncio.wait_for(service.reserve("r3", 40, 8, TransportKind.SHM), timeout=30)
        assert not gate.is_set()
        assert len(destination.page_ids) == 3 and service.engine.num_free_pages == total - 3
        assert service.load.leases == 1 and service.load.free_pages == total - 3
        if how == "release":
            assert await service.release("r3")
        else:
            service.abandon("r3", destination.lease_id)
        assert not gate.is_set()
        assert service.engine.num_free_pages == total and service.load.leases == 0
    assert not await service.release("r3")
    assert await service._port.engine_thread.call(lambda engine: engine.num_free_pages) == total


async def test_lease_deadline_follows_the_callers_deadline(service):
    """ttl_s (the Reserve call's remaining time) shortens the lease below lease_ttl_s, never lengthens it."""
    # Deadlines are bracketed by the clock before and after the calls (+-1 ms of rounding), so a loaded machine
    # that delays the calls cannot move them out of range: short gets its 50 ms, long is capped at lease_ttl_s 0.3.
    before_ms = time.time() * 1000 - 1
    short = await service.reserve("r4", 16, 4, TransportKind.SHM, ttl_s=0.05)
    long = await service.reserve("r5", 16, 4, TransportKind.SHM, ttl_s=1000.0)
    after_ms = time.time() * 1000 + 1
    assert before_ms + 50 <= short.lease_deadline_unix_ms <= after_ms + 50
    assert before_ms + 300 <= long.lease_deadline_unix_ms <= after_ms + 300
    for request_id in ("r4", "r5"):
        await service.release(request_id)


async def test_complete_small_kv_is_admitted_on_the_event_loop(service, monkeypatch):
    """A Decode whose KV is already complete (the gateway's order: Prefill returned first) and small is
    admitted on the event loop: the receiver's check runs on the loop's thread, no worker thread is used,
    and the request streams to its end."""
    receiver = service.receivers[TransportKind.SHM]
    admitted_on: list[threading.Thread] = []
    admit = receiver.admit
    monkeypatch.setattr(receiver, "admit", lambda *a, **k: admitted_on.append(threading.current_thread()) or admit(*a, **k))
    hops: list[object] = []
    to_thread = asyncio.to_thread
    monkeypatch.setattr(asyncio, "to_thread", lambda fn, *a, **k: hops.append(fn) or to_thread(fn, *a, **k))
    destination = await service.reserve("r6", 20, 4, TransportKind.SHM)
    mark_kv_complete(service.engine, destination)
    tokens = [t async for update in service.decode("r6", destination.lease_id, [5] * 20, 7, greedy(4))
              for t in update.token_ids]
    assert len(tokens) == 3  # the first of the 4 came from prefill
    assert admitted_on == [threading.current_thread()] and hops == []


async def test_standing_lease_is_narrowed_to_the_prompt_that_claims_it(service):
    """A standing lease granted for 64 tokens (4 pages) is claimed by a 20-token prompt: the KV written into
    the narrowed destination (2 pages, bound to the whole lease) is admitted, the 2 pages past the prompt go
    back at the claim (checked while the request still runs: it asks for 128 tokens), the request streams to its end and every page is free again; the lease cannot be
    claimed a second time. The load tells the unclaimed spare from an ordinary lease (standing_*)."""
    total, admitted = service.load.free_pages, service.load.requests_total
    destination = await service.reserve("s1", 64, 1, TransportKind.SHM, standing=True)
    assert len(destination.page_ids) == 4 and service.load.leased_pages == 4
    assert (service.load.standing_leases, service.load.standing_pages, service.load.requests_total) == (1, 4, admitted)
    mark_kv_complete(service.engine, destination.narrowed(20, PAGE_SIZE))
    stream = service.decode("s1", destination.lease_id, [5] * 20, 7, greedy(128))
    first = await anext(stream)
    assert (service.load.leases, service.load.standing_leases, service.load.standing_pages) == (0, 0, 0)
    assert service.load.requests_total == admitted + 1  # a spare counts as a request once claimed
    assert service.book.get("s1").lease.page_ids == destination.page_ids[:2]
    tokens = list(first.token_ids) + [t async for update in stream for t in update.token_ids]
    assert len(tokens) == 127
    await _settled(service, total)
    with pytest.raises(NotFound):
        async for _ in service.decode("s1", destination.lease_id, [5] * 20, 7, greedy(4)):
            pass


async def test_standing_lease_claims_are_checked(service):
    """Claiming a standing lease with a longer prompt than it holds, or a prompt + max_new_tokens past the
    model's context, is INVALID_ARGUMENT and leaves the lease to its holder (Release frees it); a plain
    lease still needs its exact prompt length (and is not counted as standing); standing leases travel by shm
    only."""
    total = service.load.free_pages
    destination = await service.reserve("s2", 32, 1, TransportKind.SHM, standing=True)
    context = service.engine.model_config.max_position_embeddings
    for prompt, max_new in ((33, 4), (20, context)):
        with pytest.raises(InvalidArgument):
            async for _ in service.decode("s2", destination.lease_id, [5] * prompt, 7, greedy(max_new)):
                pass
    assert (service.load.leases, service.load.standing_leases, service.load.standing_pages) == (1, 1, 2)
    assert await service.release("s2")
    plain = await service.reserve("s3", 32, 4, TransportKind.SHM)
    assert (service.load.leases, service.load.standing_leases, service.load.standing_pages) == (1, 0, 0)
    with pytest.raises(InvalidArgument):
        async for _ in service.decode("s3", plain.lease_id, [5] * 20, 7, greedy(4)):
            pass
    assert await service.release("s3")
    with pytest.raises(FailedPrecondition, match="shm only"):
        await service.reserve("s4", 32, 1, TransportKind.GRPC, standing=True)
    await _settled(service, total)


async def test_an_unclaimed_standing_lease_keeps_its_growth_headroom(service_model):
    """A standing lease will run the moment a prompt claims it, without passing admission again, so later
    reservations keep one request's growth free for it (as for a running request): the reservation that
    would take those pages is refused, one that leaves them is granted; once the spare is released its
    headroom is no longer kept. (Leases live 60 s here: no expiry races the test.)"""
    async with _running_service(service_model, lease_ttl_s=60.0) as service:
        total = service.load.free_pages
        growth = growth_pages(service.config.spec_block_size, PAGE_SIZE)
        spare = await service.reserve("spare", PAGE_SIZE, 1, TransportKind.SHM, standing=True)
        free = total - len(spare.page_ids)
        with pytest.raises(ResourceExhausted, match="standing"):
            await service.reserve("greedy", PAGE_SIZE * (free - growth + 1), 1, TransportKind.SHM)
        fitting = await service.reserve("fits", PAGE_SIZE * (free - growth), 1, TransportKind.SHM)
        assert len(fitting.page_ids) == free - growth and service.load.free_pages == growth
        assert await service.release("fits") and await service.release("spare")
        refused_before = await service.reserve("greedy", PAGE_SIZE * (free - growth + 1), 1, TransportKind.SHM)
        assert len(refused_before.page_ids) == free - growth + 1
        assert await service.release("greedy")
        await _settled(service, total)
