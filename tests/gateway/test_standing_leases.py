"""StandingLeases: the gateway's spare decode reservations (fake decode stubs, no processes)."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc
import pytest

from gateway.config import DEFAULT_STANDING_LEASE_TOKENS, GatewayConfig
from gateway.standing_leases import narrowed_destination
from gateway.workers import WorkerPool
from kvtransfer.destination import Destination
from rpc.internal.v1 import kv_pb2, worker_pb2

PAGE_SIZE = 16
TOKENS = 64  # a spare holds 4 pages


class _LeasingDecode:
    """A decode worker's lease book in miniature: Reserve grants pages under a lease of `timeout` seconds
    (lease_s overrides it), Release frees them; `held` is what is reserved now."""

    def __init__(self, lease_s: float | None = None) -> None:
        self.lease_s = lease_s
        self.held: dict[str, kv_pb2.KVDestination] = {}
        self.requests: list[worker_pb2.ReserveRequest] = []
        self.refuse: grpc.StatusCode | None = None
        self._next_page = 0

    async def Reserve(self, request, timeout=None, metadata=()):  # noqa: N802 - gRPC method name
        self.requests.append(request)
        if self.refuse is not None:
            raise grpc.aio.AioRpcError(self.refuse, grpc.aio.Metadata(), grpc.aio.Metadata(), details="refused")
        pages = -(-request.num_prompt_tokens // PAGE_SIZE)
        page_ids = list(range(self._next_page, self._next_page + pages))
        self._next_page += pages
        lease_s = self.lease_s if self.lease_s is not None else (timeout or 30.0)
        destination = kv_pb2.KVDestination(
            transport=kv_pb2.TRANSPORT_SHM, layout_hash="h", page_ids=page_ids, targets=["pool"],
            request_id=request.request_id, lease_id=f"lease-{request.request_id}",
            lease_deadline_unix_ms=int((time.time() + lease_s) * 1000), num_tokens=request.num_prompt_tokens)
        self.held[request.request_id] = destination
        return worker_pb2.ReserveResponse(destination=destination)

    async def Release(self, request, timeout=None, metadata=()):  # noqa: N802
        return worker_pb2.ReleaseResponse(found=self.held.pop(request.request_id, None) is not None)


def _pool(fake: _LeasingDecode, ttl_s: float = 30.0) -> WorkerPool:
    config = GatewayConfig(model_dir="unused", prefill=("127.0.0.1:1",), decode=("127.0.0.1:2",), transport="shm",
                           load_poll_interval_s=0.01, standing_lease_tokens=TOKENS, standing_lease_ttl_s=ttl_s)
    pool = WorkerPool(config)
    worker = pool.decode[0]
    worker.stub = fake
    worker.load.healthy, worker.load.free_pages, worker.load.page_size = True, 100, PAGE_SIZE
    return pool


async def _eventually(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)


def _refill_passes(pool: WorkerPool) -> asyncio.Queue[None]:
    """A queue that gets one item whenever the spares' refill task ends a pass (before it waits for the next)."""
    passes: asyncio.Queue[None] = asyncio.Queue()
    wait_between_passes = pool.standing._sleep

    async def counted(seconds: float) -> None:
        passes.put_nowait(None)
        await wait_between_passes(seconds)

    pool.standing._sleep = counted  # type: ignore[method-assign]
    return passes


async def _started(fake: _LeasingDecode, ttl_s: float = 30.0) -> WorkerPool:
    pool = _pool(fake, ttl_s)
    assert pool.standing is not None
    pool.polled.set()
    pool.standing.start()
    await _eventually(lambda: len(pool.standing.held()) == 1, "a spare")
    return pool


async def test_on_by_default_and_zero_turns_it_off():
    """The default config keeps spares of DEFAULT_STANDING_LEASE_TOKENS (1024) prompt tokens; with
    standing_lease_tokens=0 the pool keeps no spare and take_standing gives nothing."""
    addresses = dict(model_dir="unused", prefill=("127.0.0.1:1",), decode=("127.0.0.1:2",))
    assert GatewayConfig(**addresses).standing_lease_tokens == DEFAULT_STANDING_LEASE_TOKENS == 1024
    pool = WorkerPool(GatewayConfig(**addresses))
    assert pool.standing is not None and pool.standing.tokens == 1024
    await pool.close()
    pool = WorkerPool(GatewayConfig(**addresses, standing_lease_tokens=0))
    assert pool.standing is None and pool.take_standing(10) is None
    await pool.close()


@pytest.mark.parametrize("code", [grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION])
async def test_a_spare_the_worker_can_never_grant_is_not_asked_for_again_soon(code):
    """A worker that refuses the spare for good (its context or pool is too small for it, or it does not
    serve shm) is asked again only after REFUSED_RETRY_S, not at every refill pass; no spare is held."""
    fake = _LeasingDecode()
    fake.refuse = code
    pool = _pool(fake)
    passes = _refill_passes(pool)
    pool.polled.set()
    pool.standing.start()
    await _eventually(lambda: len(fake.requests) == 1, "the first Reserve")
    for _ in range(20):  # 20 more refill passes (poll interval 0.01 s), each seen to end
        await asyncio.wait_for(passes.get(), 60)
    assert len(fake.requests) == 1 and pool.standing.held() == []
    await pool.close()


async def test_take_narrows_claims_once_and_refills():
    """A spare is reserved as standing for TOKENS prompt tokens; a fitting prompt takes it once, narrowed to
    its pages but bound to the whole lease (same binding); the refill task then reserves a fresh one."""
    fake = _LeasingDecode()
    pool = await _started(fake)
    first = fake.requests[0]
    assert first.standing and first.num_prompt_tokens == TOKENS and first.transport == kv_pb2.TRANSPORT_SHM
    spare = pool.standing.held()[0].destination
    worker, taken = pool.take_standing(20)
    assert worker is pool.decode[0] and taken.request_id == spare.request_id and taken.lease_id == spare.lease_id
    narrowed = Destination.from_proto(taken)
    assert narrowed.page_ids == tuple(spare.page_ids[:2]) and narrowed.num_tokens == 20
    assert narrowed.binding == Destination.from_proto(spare).binding
    assert pool.standing.taken == 1 and pool.decode[0].load.running == 1
    pool.refill_standing()  # as the run does once its prefill returned
    await _eventually(lambda: len(pool.standing.held()) == 1, "a refill")
    second = pool.standing.held()[0].destination
    assert second.request_id != spare.request_id  # a new lease, not the taken one again
    assert pool.take_standing(TOKENS)[1].request_id == second.request_id
    await pool.close()


async def test_a_spare_is_taken_only_from_the_routers_first_choice():
    """When the worker the router ranks first holds no spare, the request Reserves there as usual rather than
    taking another worker's spare (spares must not steer routing); the spare stays for a later request."""
    fake = _LeasingDecode()
    pool = await _started(fake)
    assert pool.standing.take(20, [1, 0]) is None  # worker 1 (ranked first) holds no spare
    assert len(pool.standing.held()) == 1 and pool.standing.taken == 0
    worker, _ = pool.standing.take(20, [0, 1])
    assert worker is pool.decode[0] and pool.standing.taken == 1
    await pool.close()


async def test_take_refuses_long_prompts_and_unreachable_workers():
    """A prompt longer than the spare, or a spare on a worker marked unreachable, is not taken (Reserve as
    usual); an unreachable worker's spare is dropped by the refill task and not refilled."""
    fake = _LeasingDecode()
    pool = await _started(fake)
    assert pool.take_standing(TOKENS + 1) is None
    pool.decode[0].load.healthy = False
    assert pool.take_standing(10) is None
    await _eventually(lambda: not pool.standing.held(), "the dropped spare")
    assert pool.standing.taken == 0
    await pool.close()


async def test_ageing_spare_is_replaced_and_released():
    """A spare with less than half its lease left is never handed out: the refill task releases it and
    reserves a fresh one, so the worker holds one spare, not two."""
    fake = _LeasingDecode(lease_s=0.5)  # the worker caps the lease below the 30 s asked for
    pool = await _started(fake)
    stale = pool.standing.held()[0].destination.request_id
    assert pool.take_standing(10) is None  # 0.5 s left < 15 s
    await _eventually(lambda: stale not in fake.held, "the ageing spare's release")
    await _eventually(lambda: len(fake.held) == 1 and len(pool.standing.held()) == 1, "one fresh spare")
    await pool.close()


async def test_close_releases_every_spare():
    """Gateway shutdown releases the spare on its worker (no page stays reserved) and stops refilling."""
    fake = _LeasingDecode()
    pool = await _started(fake)
    assert len(fake.held) == 1
    await pool.close()
    assert fake.held == {}
    assert pool.standing._task is not None and pool.standing._task.done()  # no refill pass can Reserve again


async def test_full_worker_gets_its_spare_back():
    """A Reserve refused for room releases the worker's spare (the request may have those pages), and no
    new spare is taken while the worker reports too few free pages."""
    fake = _LeasingDecode()
    pool = await _started(fake)
    spare = pool.standing.held()[0].destination.request_id

    class _FullThenRoom:
        calls = 0

        async def Reserve(self, request, timeout=None, metadata=()):  # noqa: N802
            self.calls += 1
            if self.calls == 1:
                raise grpc.aio.AioRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.aio.Metadata(),
                                           grpc.aio.Metadata(), details="full")
            return await fake.Reserve(request, timeout, metadata)

        Release = fake.Release

    pool.decode[0].stub = _FullThenRoom()
    pool.decode[0].load.free_pages = 1  # too few for a spare until a poll says otherwise
    worker, destination = await pool.reserve("r", 10, 5, deadline=None)
    assert destination.request_id == "r"
    await _eventually(lambda: spare not in fake.held, "the spare's release")
    passes = _refill_passes(pool)
    for _ in range(3):  # three refill passes end with the worker still short of pages
        await asyncio.wait_for(passes.get(), 60)
    assert pool.standing.held() == [] and set(fake.held) == {"r"}
    await pool.close()


@pytest.mark.parametrize(("free_slots", "spare"), [(None, True), (2, True), (1, False), (0, False)])
async def test_a_spare_never_takes_the_last_state_slot(free_slots, spare):
    """With linear attention a spare holds a state slot: it is made only where two slots are free (by the last
    load report; None: the model has no state slots), as it is only where two spares' pages are."""
    fake = _LeasingDecode()
    pool = _pool(fake)
    pool.decode[0].load.free_state_slots = free_slots
    assert pool.standing._has_room(pool.decode[0]) is spare
    pool.decode[0].load.free_state_slots, pool.decode[0].load.free_pages = 2, 2 * (TOKENS // PAGE_SIZE) - 1
    assert not pool.standing._has_room(pool.decode[0])  # one page short of two spares
    if spare:
        pool.decode[0].load.free_state_slots, pool.decode[0].load.free_pages = free_slots, 100
        pool.polled.set()
        pool.standing.start()
        await _eventually(lambda: len(pool.standing.held()) == 1, "a spare")
        assert pool.decode[0].load.free_state_slots == (None if free_slots is None else free_slots - 1)
    await pool.close()


@pytest.mark.parametrize("bad", [0, -1])
def test_ttl_must_be_positive(bad):
    """standing_lease_ttl_s <= 0 is refused by name; negative standing_lease_tokens too."""
    with pytest.raises(ValueError, match="standing_lease_ttl_s"):
        GatewayConfig(model_dir="unused", prefill=("127.0.0.1:1",), decode=("127.0.0.1:2",), standing_lease_ttl_s=bad)
    with pytest.raises(ValueError, match="standing_lease_tokens"):
        GatewayConfig(model_dir="unused", prefill=("127.0.0.1:1",), decode=("127.0.0.1:2",), standing_lease_tokens=-1)


@pytest.mark.parametrize("tokens", [1, 16, 17, 40, TOKENS])
@pytest.mark.parametrize("state_slot", [None, 3])
def test_narrowed_message_matches_the_destinations_own(tokens, state_slot):
    """narrowed_destination (on the message, the gateway's take() path) gives the message
    Destination.narrowed(...).to_proto() gives, every field alike, state slot or none; narrowing twice too."""
    spare = Destination(transport=1, layout_hash="h", request_id="standing.1", lease_id="secret",
                        page_ids=(9, 4, 7, 2), targets=("pool-0", "pool-1"), lease_deadline_unix_ms=123,
                        num_tokens=TOKENS, pool_num_pages=64, completion_slot=5, completion_sequence=8,
                        state_slot=state_slot)
    expected = spare.narrowed(tokens, PAGE_SIZE)
    assert narrowed_destination(spare.to_proto(), tokens, PAGE_SIZE) == expected.to_proto()
    again = narrowed_destination(expected.to_proto(), 1, PAGE_SIZE)
    assert again == expected.narrowed(1, PAGE_SIZE).to_proto()
    assert Destination.from_proto(again).binding == spare.binding  # still bound to the whole lease


@pytest.mark.parametrize("tokens", [0, TOKENS + 1])
def test_narrowing_beyond_the_lease_is_refused(tokens):
    """Zero tokens or more than the lease holds: ValueError, as Destination.narrowed."""
    message = kv_pb2.KVDestination(page_ids=[1, 2, 3, 4], num_tokens=TOKENS)
    with pytest.raises(ValueError, match="cannot narrow"):
        narrowed_destination(message, tokens, PAGE_SIZE)


async def test_a_prompt_the_decode_worker_holds_part_of_reserves_instead(monkeypatch):
    """When the KV index says the decode worker holds some of the prompt's pages, take_standing gives nothing (a
    spare takes no decode-side lookup; a Reserve maps the pages); a prompt it holds nothing of takes the spare."""
    from gateway.kv_index import Overlap, PromptKeys

    fake = _LeasingDecode()
    pool = await _started(fake)
    held = PromptKeys(list(range(20)))
    monkeypatch.setattr(pool, "overlap", lambda address, prompt: Overlap(16, 16) if prompt is held else Overlap())
    assert pool.take_standing(20, held) is None and pool.standing.taken == 0
    assert pool.take_standing(20, PromptKeys(list(range(100, 120)))) is not None and pool.standing.taken == 1
    await pool.close()
