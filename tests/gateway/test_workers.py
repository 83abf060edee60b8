"""WorkerPool.reserve: the admission policy when decode workers are full or unreachable (fake stubs)."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from gateway.config import GatewayConfig
from gateway.workers import WorkerPool
from rpc.status import ResourceExhausted, Unavailable
from rpc.internal.v1 import kv_pb2, worker_pb2
from tests.services.helpers import eventually


def _error(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=code.name)


class _FakeDecode:
    """Answers Reserve from a script: a status code to fail with, or None to succeed."""

    def __init__(self, script: list[grpc.StatusCode | None]) -> None:
        self.script = list(script)
        self.calls = 0

    async def Reserve(self, request, timeout=None, metadata=()):  # noqa: N802 - gRPC method name
        self.calls += 1
        outcome = self.script.pop(0) if self.script else None
        if outcome is not None:
            raise _error(outcome)
        return worker_pb2.ReserveResponse(destination=kv_pb2.KVDestination(request_id=request.request_id, page_ids=[1, 2]))


async def _pool(scripts, admission_timeout_s=5.0) -> tuple[WorkerPool, list[_FakeDecode]]:
    config = GatewayConfig(model_dir="unused", prefill=("127.0.0.1:1",), decode=tuple(f"127.0.0.1:{i + 2}" for i in range(len(scripts))),
                           admission_timeout_s=admission_timeout_s)
    pool = WorkerPool(config)
    fakes = [_FakeDecode(script) for script in scripts]
    for worker, fake, free in zip(pool.decode, fakes, range(100, 0, -10)):
        worker.stub = fake
        worker.load.healthy, worker.load.free_pages = True, free  # the first worker looks emptiest
    return pool, fakes


async def test_full_worker_is_skipped_for_the_next():
    """RESOURCE_EXHAUSTED from the best worker moves the request to the next one."""
    pool, fakes = await _pool([[grpc.StatusCode.RESOURCE_EXHAUSTED], []])
    worker, destination = await pool.reserve("r", 10, 5, deadline=None)
    assert worker is pool.decode[1] and destination.request_id == "r"
    assert [fake.calls for fake in fakes] == [1, 1]
    await pool.close()


async def test_all_full_retries_until_room_appears():
    """When every worker is full the gateway waits and retries; a later success is returned."""
    pool, fakes = await _pool([[grpc.StatusCode.RESOURCE_EXHAUSTED] * 3])
    worker, _ = await pool.reserve("r", 10, 5, deadline=None)
    assert worker is pool.decode[0] and fakes[0].calls == 4
    await pool.close()


async def test_gives_up_after_the_admission_timeout():
    """A pool that stays full fails the request with ResourceExhausted once the admission timeout passes."""
    pool, fakes = await _pool([[grpc.StatusCode.RESOURCE_EXHAUSTED] * 1000], admission_timeout_s=0.2)
    with pytest.raises(ResourceExhausted):
        await pool.reserve("r", 10, 5, deadline=None)
    assert fakes[0].calls >= 2
    await pool.close()


async def test_unreachable_worker_is_marked_and_skipped():
    """UNAVAILABLE marks the worker unhealthy (health turns NOT_SERVING) and the next worker is used;
    with none left the request is Unavailable; other errors pass through."""
    pool, fakes = await _pool([[grpc.StatusCode.UNAVAILABLE], []])
    worker, _ = await pool.reserve("r", 10, 5, deadline=None)
    assert worker is pool.decode[1] and not pool.decode[0].load.healthy and not pool.healthy
    pool.decode[1].load.healthy = False
    with pytest.raises(Unavailable):
        await pool.reserve("s", 10, 5, deadline=None)
    pool.decode[1].load.healthy = True
    fakes[1].script = [grpc.StatusCode.INVALID_ARGUMENT]
    with pytest.raises(grpc.aio.AioRpcError):
        await pool.reserve("t", 10, 5, deadline=None)
    await pool.close()


class _SlowDecode(_FakeDecode):
    """Reserve succeeds only after `gate` opens; Release calls are recorded."""

    def __init__(self) -> None:
        super().__init__([])
        self.gate = asyncio.Event()
        self.entered = asyncio.Event()
        self.waiting = 0  # Reserve calls held at the gate
        self.released: list[str] = []

    async def Reserve(self, request, timeout=None, metadata=()):  # noqa: N802
        self.entered.set()
        self.waiting += 1
        await self.gate.wait()
        return await super().Reserve(request, timeout)

    async def Release(self, request, timeout=None, metadata=()):  # noqa: N802
        self.released.append(request.request_id)


async def test_cancel_during_reserve_releases_what_it_reserved():
    """A request cancelled while its Reserve is in flight waits for that call and then releases the
    reservation (a Release sent earlier could arrive before the Reserve and miss it)."""
    pool, _ = await _pool([[]])
    slow = _SlowDecode()
    pool.decode[0].stub = slow
    task = asyncio.create_task(pool.reserve("r", 10, 5, deadline=None))
    await asyncio.wait_for(slow.entered.wait(), timeout=60)
    assert pool.decode[0].load.running == 1  # claimed while the Reserve is out
    task.cancel()
    await eventually(lambda: pool.decode[0].load.running == 0, "the cancellation to reach reserve() (unclaimed)")
    assert not task.done() and slow.released == []  # still waiting for the Reserve reply
    slow.gate.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert slow.released == ["r"]
    await pool.close()


class _StoppedDecode(_SlowDecode):
    """A SIGSTOPped worker: its gate never opens; a cancelled Reserve is recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.cancelled = asyncio.Event()

    async def Reserve(self, request, timeout=None, metadata=()):  # noqa: N802
        try:
            return await super().Reserve(request, timeout)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


async def test_a_reserve_to_a_worker_found_hung_is_cancelled_and_the_next_worker_serves():
    """A Reserve in flight to a stopped worker (it never answers) is given up when hang detection takes that
    worker for hung: the call is cancelled, the request reserves on the next worker; Decodes submitted to the
    hung worker fail UNAVAILABLE at once (they migrate) until a probe answers again."""
    pool, fakes = await _pool([[], []])
    stopped = _StoppedDecode()
    pool.decode[0].stub = stopped
    reserving = asyncio.create_task(pool.reserve("r", 10, 5, deadline=None))
    await asyncio.wait_for(stopped.entered.wait(), 30)
    for _ in range(pool.liveness.config.hang_probe_failures):
        pool.liveness.probed(pool.decode[0], answered=False)
    worker, destination = await asyncio.wait_for(reserving, 30)
    assert worker is pool.decode[1] and destination.request_id == "r" and fakes[1].calls == 1
    assert not pool.decode[0].load.healthy and stopped.waiting == 1
    await asyncio.wait_for(stopped.cancelled.wait(), 30)
    late = pool.decode[0].stream.submit(worker_pb2.DecodeRequest(request_id="late"), 60)
    with pytest.raises(grpc.aio.AioRpcError) as error:
        async for _ in late:
            pass
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE and "stopped answering" in error.value.details()
    pool.liveness.probed(pool.decode[0], answered=True)
    assert pool.decode[0].stream.hung is None
    await pool.close()


async def test_a_burst_is_spread_while_its_reserves_are_in_flight():
    """Requests routed while earlier Reserves are still in flight see those claims: a burst of four arriving
    together over two almost equally free workers is split 2 / 2, not sent whole to the one that looked a page
    emptier. When the answers come, each worker's estimate becomes the pages it actually reserved; a refused
    Reserve gives back what it claimed."""
    pool, _ = await _pool([[], []])
    slow = [_SlowDecode(), _SlowDecode()]
    for worker, fake, free in zip(pool.decode, slow, (41, 40)):
        worker.stub, worker.load.free_pages, worker.load.running = fake, free, 0
    tasks = [asyncio.create_task(pool.reserve(f"r{i}", 40, 5, deadline=None)) for i in range(4)]
    await eventually(lambda: sum(fake.waiting for fake in slow) == 4, "every request to send its Reserve")
    assert [fake.calls for fake in slow] == [0, 0] and [w.load.running for w in pool.decode] == [2, 2]
    assert [w.load.free_pages for w in pool.decode] == [41 - 2 * 3, 40 - 2 * 3]  # 41 prompt + first token: 3 pages
    for fake in slow:
        fake.gate.set()
    chosen = [worker for worker, _ in await asyncio.gather(*tasks)]
    assert [chosen.count(w) for w in pool.decode] == [2, 2]
    assert [w.load.free_pages for w in pool.decode] == [41 - 2 * 2, 40 - 2 * 2]  # the fakes reserve 2 pages each
    slow[0].script = [grpc.StatusCode.INVALID_ARGUMENT]
    slow[1].script = [grpc.StatusCode.INVALID_ARGUMENT]
    with pytest.raises(grpc.aio.AioRpcError):
        await pool.reserve("bad", 40, 5, deadline=None)
    assert [w.load.free_pages for w in pool.decode] == [37, 36] and [w.load.running for w in pool.decode] == [2, 2]
    await pool.close()


@pytest.mark.parametrize("code", [grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED])
async def test_reserve_with_unknown_outcome_is_released(code):
    """A Reserve that fails with DEADLINE_EXCEEDED / CANCELLED may still have reserved on the worker (its
    answer was lost): the gateway sends Release for it before giving up; RESOURCE_EXHAUSTED does not."""
    pool, _ = await _pool([[]])
    fake = _SlowDecode()
    fake.script = [code]
    fake.gate.set()
    pool.decode[0].stub = fake
    with pytest.raises(grpc.aio.AioRpcError):
        await pool.reserve("r", 10, 5, deadline=None)
    assert fake.released == ["r"]
    await pool.close()


async def test_reserve_carries_the_transport_chosen_from_both_ends():
    """With --transport auto, Reserve asks each decode worker for the transport that fits where it and the
    prefill workers are: shm to a same-node CPU pool, device to a same-node device pool, grpc to another node;
    prefill workers in different places make it grpc (the prefill worker is picked after Reserve)."""
    from gateway.transport_choice import Placement

    class _Recording(_FakeDecode):
        async def Reserve(self, request, timeout=None, metadata=()):  # noqa: N802
            self.transports = [*getattr(self, "transports", []), request.transport]
            return await super().Reserve(request, timeout, metadata)

    config = GatewayConfig(model_dir="unused", prefill=("127.0.0.1:1", "127.0.0.1:2"), decode=("127.0.0.1:3",))
    pool = WorkerPool(config)
    fake = _Recording([])
    pool.decode[0].stub, pool.decode[0].load.healthy, pool.decode[0].load.free_pages = fake, True, 100
    for worker in pool.prefill:
        worker.load.healthy, worker.load.placement = True, Placement("node-a", device="cpu")
    for pool_kind, node in (("shm", "node-a"), ("device", "node-a"), ("shm", "node-b")):
        pool.decode[0].load.placement = Placement(node, kv_pool=pool_kind)
        await pool.reserve(f"r-{pool_kind}-{node}", 10, 5, deadline=None)
    pool.prefill[1].load.placement = Placement("node-a", device="cuda")
    pool.decode[0].load.placement = Placement("node-a", kv_pool="device")
    await pool.reserve("r-mixed", 10, 5, deadline=None)
    assert fake.transports == [kv_pb2.TRANSPORT_SHM, kv_pb2.TRANSPORT_DEVICE, kv_pb2.TRANSPORT_GRPC, kv_pb2.TRANSPORT_GRPC]
    await pool.close()
