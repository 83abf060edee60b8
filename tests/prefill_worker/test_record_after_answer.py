"""PrefillService over a real shm pool (a fake engine that writes nothing: the pages are already in place):
the caller is answered before the completion record is written; the record follows at once (or, given
reply_sent, once the caller says its reply is out) and verifies on the decode side; a job whose caller went
away before it took its answer gets no record."""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from engine.runtime.outputs import PrefillJob, PrefillResult
from engine.cache.kv_cache import PageAllocator
from kvtransfer.layout import KVLayout
from kvtransfer.leases import LeaseTable
from kvtransfer.shm_pool import SharedPagePool
from kvtransfer.shm_receiver import ShmReceiver
from prefill_worker.config import PrefillWorkerConfig
from prefill_worker.service import JobState, PrefillService
from tests.prefill_worker.in_place_engine import InPlaceEngine
from tests.services.helpers import eventually, greedy

LAYOUT = KVLayout(num_layers=2, latent_dim=16, rope_dim=4, page_size=16, dtype="float32")
FIRST = 7


class _InPlaceEngine(InPlaceEngine):
    """Answers every prompt with FIRST at once; `gate` (when given) holds the prefill until it is set."""

    def __init__(self, gate: Any = None) -> None:
        super().__init__(LAYOUT)
        self.gate = gate

    def prefill(self, jobs: list[PrefillJob],
                should_stop: Callable[[str], bool] | None = None) -> list[PrefillResult | None]:
        if self.gate is not None:
            assert self.gate.wait(60)
        return [PrefillResult(job.request_id, FIRST, None, len(job.prompt_ids), 0.0) for job in jobs]


class _ReplySent(asyncio.Event):
    """A caller's reply_sent that tells when the job starts waiting on it (`awaited`)."""

    def __init__(self) -> None:
        super().__init__()
        self.awaited = asyncio.Event()

    async def wait(self) -> bool:
        self.awaited.set()
        return await super().wait()


@pytest.fixture
def decode_side() -> Iterator[tuple[ShmReceiver, Any]]:
    """(receiver, reserve(request_id, tokens) -> Destination) over one shm pool, as a decode worker holds it."""
    with SharedPagePool.create(LAYOUT, 16, num_slots=4) as pool:
        allocator, leases = PageAllocator(16), LeaseTable(grace_s=0)
        receiver = ShmReceiver([pool])

        def reserve(request_id: str, tokens: int):
            pages = allocator.allocate(LAYOUT.pages_for_tokens(tokens))
            return receiver.expect(leases.grant(request_id, pages, 60), tokens)

        yield receiver, reserve


async def _service(engine: _InPlaceEngine) -> PrefillService:
    service = PrefillService(PrefillWorkerConfig.build(), engine_factory=lambda: engine)
    await service.start()
    return service


async def test_answer_comes_before_the_completion_record_which_then_verifies(decode_side):
    """When prefill() returns, the first token is known and the record is not written yet (transfer_ms 0);
    the record follows without another request, and the decode side admits the KV with a matching checksum."""
    receiver, reserve = decode_side
    service = await _service(_InPlaceEngine())
    try:
        outcome = await service.prefill("a", [5] * 20, greedy(4), reserve("a", 20))
        assert outcome.first_token == FIRST and outcome.transfer_ms == 0.0
        assert not receiver.ready("a")  # answered first: the record is written once the answer is taken
        await eventually(lambda: receiver.ready("a"), "the completion record")
        admitted = receiver.admit_now("a", 1 << 20)
        assert admitted is not None and admitted.bytes == LAYOUT.request_bytes(2)
        assert await service.cancel("a") is False  # finished: nothing left to stop
    finally:
        await service.stop()


async def test_the_record_waits_until_the_reply_is_out(decode_side):
    """Given reply_sent, the job's hand-off waits on it before the record (the reply is still being sent): once
    it waits there, the record is not written, and it is written once reply_sent is set."""
    receiver, reserve = decode_side
    service = await _service(_InPlaceEngine())
    reply_sent = _ReplySent()
    try:
        outcome = await service.prefill("c", [5] * 20, greedy(4), reserve("c", 20), reply_sent)
        assert outcome.first_token == FIRST
        await asyncio.wait_for(reply_sent.awaited.wait(), 60)  # the hand-off waits for the reply
        assert not receiver.ready("c")
        reply_sent.set()
        await eventually(lambda: receiver.ready("c"), "the completion record")
        assert receiver.admit_now("c", 1 << 20) is not None
    finally:
        await service.stop()


async def test_a_cancel_before_the_reply_is_out_leaves_no_record(decode_side):
    """Cancel between the answer and the reply's departure (the gateway gave up on the call): cancel()
    returns once the job is over, and the record is never written (the pages are released, not read)."""
    receiver, reserve = decode_side
    service = await _service(_InPlaceEngine())
    reply_sent = _ReplySent()
    try:
        await service.prefill("d", [5] * 20, greedy(4), reserve("d", 20), reply_sent)
        await asyncio.wait_for(reply_sent.awaited.wait(), 60)  # the hand-off waits for the reply
        job = service._jobs["d"]
        cancel = asyncio.create_task(service.cancel("d"))
        await eventually(lambda: job.state is JobState.CANCELLED, "cancel() to mark the job")
        assert not cancel.done() and not job.over.is_set()  # the job waits for the reply to be out
        reply_sent.set()  # the call ends
        assert await asyncio.wait_for(cancel, 60) is False
        assert not receiver.ready("d")
    finally:
        await service.stop()


async def test_a_lease_released_after_the_reply_is_no_error(decode_side):
    """The decode side drops the reservation right after the reply (the request ended at its first token):
    no record is written and the prompt still counts as prefilled ok, not as an error."""
    receiver, reserve = decode_side
    service = await _service(_InPlaceEngine())
    reply_sent = asyncio.Event()
    try:
        await service.prefill("e", [5] * 20, greedy(4), reserve("e", 20), reply_sent)
        receiver.cancel("e")  # the decode worker's Release: the completion slot is no longer reserved
        reply_sent.set()
        await eventually(lambda: not service._jobs, "the job to end")
        counts = {sample.labels["status"]: sample.value for metric in service.metrics.prompts.collect()
                  for sample in metric.samples if sample.name.endswith("_total")}
        assert counts.get("ok") == 1.0 and counts.get("error", 0.0) == 0.0, counts
    finally:
        await service.stop()


async def test_a_call_cancelled_before_its_answer_gets_no_record(decode_side):
    """The RPC is cancelled while its prompt runs: the call ends cancelled, cancel() returns once the job is
    done, and no completion record is written for it (the gateway releases its lease)."""
    import threading

    receiver, reserve = decode_side
    gate = threading.Event()
    service = await _service(_InPlaceEngine(gate))
    try:
        call = asyncio.create_task(service.prefill("b", [5] * 20, greedy(4), reserve("b", 20)))
        await eventually(lambda: service.load.queued_requests == 0, "b to start")
        call.cancel()
        cancel = asyncio.create_task(service.cancel("b"))
        gate.set()
        assert await asyncio.wait_for(cancel, 60) is False  # it was running: cancel waited for it
        with pytest.raises(asyncio.CancelledError):
            await call
        assert not receiver.ready("b")
    finally:
        gate.set()
        await service.stop()


async def test_the_answer_is_given_by_the_callback_the_result_lands_in(decode_side):
    """The engine thread's result is handed over by one loop callback (PrefillService._computed) that answers an
    in-place shm prefill itself: when that callback returns, the caller's answer is set (no hop through the
    job's hand-off task or a shield first), while the record is still to come."""
    receiver, reserve = decode_side
    service = await _service(_InPlaceEngine())
    seen: list[tuple[bool, bool]] = []
    computed = service._computed

    def watched(job: Any, result: Any) -> None:
        computed(job, result)
        seen.append((job.answer.done(), receiver.ready(job.request_id)))

    service._computed = watched  # type: ignore[method-assign]
    try:
        outcome = await service.prefill("f", [5] * 20, greedy(4), reserve("f", 20), asyncio.Event())
        assert outcome.first_token == FIRST
        assert seen == [(True, False)], seen
    finally:
        await service.stop()
