"""Issue 18: a Reserve does not wait for the engine step in progress. A DecodeService over a real tiny engine
decodes one request whose decode forward is held inside the engine step; a second request's Reserve is
answered (and released) while that step is still blocked, and once the step goes on the first request
finishes normally and every page returns."""
from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

import pytest

from decode_worker.config import DecodeWorkerConfig
from decode_worker.server import _Receivers
from decode_worker.service import DecodeService
from kvtransfer.destination import TransportKind
from tests.decode_worker.thread_port import thread_port
from tests.services.decode_hooks import NextDecodeForward, mark_kv_complete
from tests.services.helpers import greedy

PROMPT = [5, 9, 13, 17, 21, 25, 29, 33, 37, 41]
MAX_TOKENS = 6
pytestmark = pytest.mark.slow  # an engine start and a decode: ~15 s on the shared machine


@pytest.fixture
async def held(service_model) -> AsyncIterator[tuple[DecodeService, NextDecodeForward, threading.Event]]:
    receivers = _Receivers()
    config = DecodeWorkerConfig.build(model_dir=str(service_model), draft_model_dir="", attention_backend="torch",
                                      kv_memory_bytes=256 * 1024, page_size=16, num_threads=1)
    service = DecodeService(config, receivers, port_factory=thread_port(config))  # reached into: an engine thread
    await service.start()
    step_may_go_on = threading.Event()
    hold = NextDecodeForward(service.engine.leader.execute, lambda: step_may_go_on.wait(120))
    service.engine.leader.execute = hold  # instance attribute: only this engine's forwards are held
    receivers.push.advertise(["127.0.0.1:1"] * len(receivers.pools))  # no pushes here; expect() needs an address
    try:
        yield service, hold, step_may_go_on
    finally:
        step_may_go_on.set()
        await service.stop()
        receivers.close()


async def test_reserve_is_answered_while_a_decode_step_is_blocked(held):
    """While the engine thread sits inside a decode step (its forward blocked on an Event), Reserve returns a
    destination, the pages leave the pool, and Release returns them; the Event is set only afterwards, so
    none of this waited for the step. Then the running request streams all its tokens and the pool is whole."""
    service, hold, step_may_go_on = held
    total = service.engine.num_free_pages
    destination = await service.reserve("running", len(PROMPT), MAX_TOKENS, TransportKind.SHM)
    mark_kv_complete(service.engine, destination)
    hold.armed.set()

    async def consume() -> list[int]:
        tokens: list[int] = []
        async for update in service.decode("running", destination.lease_id, PROMPT, 7, greedy(MAX_TOKENS)):
            tokens += update.token_ids
        return tokens

    decoding = asyncio.create_task(consume())
    try:
        assert await asyncio.to_thread(hold.fired.wait, 60), "the decode step never started"
        before = service.engine.num_free_pages
        reserved = await asyncio.wait_for(service.reserve("second", 40, 8, TransportKind.SHM), timeout=30)
        assert not step_may_go_on.is_set(), "Reserve returned only after the step went on"
        assert len(reserved.page_ids) == 3 and service.engine.num_free_pages == before - 3
        assert service.load.leases == 1
        assert await service.release("second")
        assert service.engine.num_free_pages == before and service.load.leases == 0
        assert not step_may_go_on.is_set()
    except BaseException:
        decoding.cancel()
        raise
    finally:
        step_may_go_on.set()
    assert len(await asyncio.wait_for(decoding, timeout=120)) == MAX_TOKENS - 1  # prefill made the first token
    idle = await service._port.engine_thread.call(lambda engine: (engine.has_work(), engine.num_free_pages))
    assert idle == (False, total)
