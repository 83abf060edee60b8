"""PrefillService without gRPC, over a fake engine whose prefill blocks until released: batching by
prompt tokens and by the target time, and Cancel semantics (drop when queued, wait when running, no KV
export afterwards)."""
from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest

from engine.runtime.llm_engine import PrefillResult
from kvtransfer.destination import Destination, TransportKind
from kvtransfer.layout import KVLayout
from rpc.status import AlreadyExists
from prefill_worker.config import PrefillWorkerConfig
from prefill_worker.service import JobState, PrefillService
from tests.prefill_worker.in_place_engine import InPlaceEngine
from tests.services.helpers import eventually, greedy

LAYOUT = KVLayout(num_layers=2, latent_dim=16, rope_dim=4, page_size=16, dtype="float32")


class _BlockingEngine(InPlaceEngine):
    def __init__(self) -> None:
        super().__init__(LAYOUT)
        self.release = threading.Event()
        self.batches: list[list[str]] = []
        self.stopped: list[str] = []

    def prefill(self, jobs, should_stop=None):
        """Two chunks per prompt: the first before `release` is set, then (like the engine) should_stop
        is asked before the second; a stopped prompt gets None."""
        self.batches.append([job.request_id for job in jobs])
        assert self.release.wait(60)
        stopped = {job.request_id for job in jobs if should_stop is not None and should_stop(job.request_id)}
        self.stopped.extend(sorted(stopped))
        return [None if job.request_id in stopped else PrefillResult(job.request_id, 7, None, len(job.prompt_ids), 0.0)
                for job in jobs]


def _destination(request_id: str, tokens: int) -> Destination:
    return Destination(transport=TransportKind.SHM, layout_hash=LAYOUT.hash, request_id=request_id, lease_id="l-" + request_id,
                       page_ids=tuple(range(LAYOUT.pages_for_tokens(tokens))), targets=("pdserve-kv-none",),
                       lease_deadline_unix_ms=int(time.time() * 1000) + 60_000, num_tokens=tokens, completion_slot=0)


@pytest.fixture
async def prefill():
    engine = _BlockingEngine()
    service = PrefillService(PrefillWorkerConfig.build(batch_tokens=10), engine_factory=lambda: engine)
    await service.start()
    service._confirm = lambda destination: None  # no decode pool here (ShmWriter.confirm: tests/kvtransfer)
    yield service, engine
    engine.release.set()
    await service.stop()


async def test_cancel_drops_queued_and_waits_for_running(prefill):
    """With A running and B, C queued: cancel(B) drops it at once; cancel(A) returns only after the engine
    stopped A between two chunks, and A's KV is not exported (its Prefill call ends cancelled); C still runs."""
    service, engine = prefill
    calls = {name: asyncio.create_task(service.prefill(name, [5] * 8, greedy(4), _destination(name, 8)))
             for name in ("A", "B", "C")}
    await eventually(lambda: engine.batches == [["A"]], "A to run alone")  # 8 + 8 > batch_tokens: one prompt per batch
    assert service.load.queued_requests == 2 and service.load.queued_tokens == 16
    assert await service.cancel("B") is True
    with pytest.raises(asyncio.CancelledError):
        await calls["B"]
    job_a = service._jobs["A"]
    cancel_a = asyncio.create_task(service.cancel("A"))
    await eventually(lambda: job_a.state is JobState.CANCELLED, "cancel(A) to mark A")
    assert not cancel_a.done()  # A is inside engine.prefill (only engine.release ends it): cancel waits
    engine.release.set()
    assert await cancel_a is False
    with pytest.raises(asyncio.CancelledError):
        await calls["A"]
    await eventually(lambda: calls["C"].done(), "C to finish")
    assert engine.batches == [["A"], ["C"]] and engine.stopped == ["A"]  # A stopped between its chunks
    assert await service.cancel("unknown") is False


async def test_duplicate_and_expired_requests_are_refused(prefill):
    """A request id already in flight is ALREADY_EXISTS; a destination whose lease has passed is refused."""
    service, engine = prefill
    first = asyncio.create_task(service.prefill("D", [5] * 4, greedy(4), _destination("D", 4)))
    await eventually(lambda: bool(engine.batches), "D to run")
    with pytest.raises(AlreadyExists):
        await service.prefill("D", [5] * 4, greedy(4), _destination("D", 4))
    expired = Destination(**{**_destination("E", 4).__dict__, "lease_deadline_unix_ms": 1})
    with pytest.raises(Exception, match="expired"):
        await service.prefill("E", [5] * 4, greedy(4), expired)
    engine.release.set()
    await asyncio.wait([first], timeout=60)


async def test_batch_takes_only_what_fits_the_target_time():
    """With a measured cost of 1.25 ms per token and a 10 ms target, a batch takes 8 tokens: B and C, queued
    behind A, run one per batch although batch_tokens (100) would hold both."""
    engine = _BlockingEngine()
    service = PrefillService(PrefillWorkerConfig.build(batch_tokens=100, batch_target_ms=10.0),
                             engine_factory=lambda: engine)
    await service.start()
    service._confirm = lambda destination: None  # no decode pool here
    service._cost = SimpleNamespace(ms_per_token=1.25, observe=lambda batch_ms, num_tokens: None)  # a fixed cost
    try:
        calls = [asyncio.create_task(service.prefill("A", [5] * 8, greedy(4), _destination("A", 8)))]
        await eventually(lambda: engine.batches == [["A"]], "A to run")
        calls += [asyncio.create_task(service.prefill(name, [5] * 8, greedy(4), _destination(name, 8))) for name in "BC"]
        await eventually(lambda: service.load.queued_requests == 2, "B and C to queue")
        engine.release.set()
        await asyncio.wait(calls, timeout=60)  # (their KV export fails: there is no decode pool here)
        assert all(call.done() for call in calls)
        assert engine.batches == [["A"], ["B"], ["C"]]
    finally:
        engine.release.set()
        await service.stop()
