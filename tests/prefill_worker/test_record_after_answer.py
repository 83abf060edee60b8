"""PrefillService over a real shm pool (a fake engine that writes nothing: the pages are already in place):
the RPC is answered before the completion record is written; the record follows at once (or, given
reply_sent, once the caller says its reply is out) and verifies on the decode side; a job whose RPC went
away before it took its answer gets no record."""
from __future__ import annotations

import asyncio
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from engine.kv_cache import PageAllocator
from engine.llm_engine import PrefillResult
from kvtransfer.layout import KVLayout
from kvtransfer.leases import LeaseTable
from kvtransfer.shm_pool import SharedPagePool
from kvtransfer.shm_receiver import ShmReceiver
from prefill_worker.config import PrefillWorkerConfig
from prefill_worker.service import PrefillService
from tests.services.helpers import eventually, greedy

LAYOUT = KVLayout(num_layers=2, latent_dim=16, rope_dim=4, page_size=16, dtype="float32")
FIRST = 7


class _InPlaceEngine:
    """Answers every prompt with FIRST at once; `gate` (when given) holds the prefill until it is set."""

    def __init__(self, gate: Any = None) -> None:
        self.config = SimpleNamespace(tp_size=1, page_size=LAYOUT.page_size)
        self.cache_shape = LAYOUT.to_cache_shape(8)
        self.gate = gate

    def validate_prompt(self, prompt_ids: list[int]) -> None:
        pass

    def prefill(self, jobs: list[Any], should_stop: Any = None) -> list[PrefillResult]:
        if self.gate is not None:
            assert self.gate.wait(60)
        return [PrefillResult(job.request_id, FIRST, None, len(job.prompt_ids), 0.0) for job in jobs]

    def close(self) -> None:
        pass


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
    """Given reply_sent, the record is not written while the caller has not set it (the reply is still being
    sent), and is written once it is set."""
    receiver, reserve = decode_side
    service = await _service(_InPlaceEngine())
    reply_sent = asyncio.Event()
    try:
        outcome = await service.prefill("c", [5] * 20, greedy(4), reserve("c", 20), reply_sent)
        assert outcome.first_token == FIRST
        for _ in range(20):  # nothing but reply_sent lets the record be written
            await asyncio.sleep(0)
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
    reply_sent = asyncio.Event()
    try:
        await service.prefill("d", [5] * 20, greedy(4), reserve("d", 20), reply_sent)
        cancel = asyncio.create_task(service.cancel("d"))
        for _ in range(20):
            await asyncio.sleep(0)
        assert not cancel.done()  # the job waits for the reply to be out (or the call to end)
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


async def test_the_answer_reaches_the_caller_in_the_loop_pass_the_result_lands_in(decode_side):
    """The engine thread's result is handed over by one loop callback that answers an in-place shm prefill
    itself: the caller's prefill() resumes in the very next loop pass (no hop through the job's task or a
    shield), before any callback scheduled after the result's arrival runs."""
    receiver, reserve = decode_side
    service = await _service(_InPlaceEngine())
    loop = asyncio.get_running_loop()
    passes: list[int] = []

    def tick() -> None:  # counts loop passes from the result's arrival until prefill() has returned
        passes.append(1)
        if len(passes) < 50:
            loop.call_soon(tick)

    class _Loop:  # the service's loop, but a callback from the engine thread also starts the count
        def __getattr__(self, name: str):
            return getattr(loop, name)

        def call_soon_threadsafe(self, callback, *args):
            def arrived() -> None:
                callback(*args)
                loop.call_soon(tick)

            return loop.call_soon_threadsafe(arrived)

    service._loop = _Loop()  # type: ignore[assignment]
    try:
        outcome = await service.prefill("f", [5] * 20, greedy(4), reserve("f", 20), asyncio.Event())
        assert outcome.first_token == FIRST
        assert passes == [], f"prefill() returned {len(passes)} loop passes after its result arrived"
    finally:
        await service.stop()
