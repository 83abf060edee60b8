"""The prefill side of benchmarks/profile_first_token.py: one PrefillStream request message as the real servicer
handles it (parse, PrefillService, reply message) over a real PrefillService and shm pool, the pdserve-tiny
engine with its forward replaced by an instant answer. (The stream's own set-up and its interceptors run once
per stream, not per prompt.)"""
from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import Callable
from typing import Any

from benchmarks.first_token_fixtures import Piece, quiet_info_logging, sync_piece
from engine.cache.kv_cache import PageAllocator
from engine.runtime.llm_engine import PrefillResult
from engine.sampling_params import SamplingParams
from kvtransfer.destination import Destination
from kvtransfer.layout import KVLayout
from kvtransfer.leases import LeaseTable
from kvtransfer.shm_pool import SharedPagePool
from kvtransfer.shm_receiver import ShmReceiver
from prefill_worker.config import PrefillWorkerConfig
from prefill_worker.service import PrefillService, _build_engine
from prefill_worker.servicer import PrefillServicer
from rpc.convert import sampling_fields, sampling_to_proto
from rpc.internal.v1 import worker_pb2


class _InstantEngine:
    """The real engine's config, cache shape and prompt checks; prefill answers at once (no forward)."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.config, self.cache_shape = engine.config, engine.cache_shape
        self.validate_prompt = engine.validate_prompt

    def prefill(self, jobs: list[Any], should_stop: Any = None) -> list[PrefillResult]:
        for job in jobs:  # as the engine asks before its first chunk
            if should_stop is not None and should_stop(job.request_id):
                return [None] * len(jobs)  # type: ignore[list-item]
        return [PrefillResult(job.request_id, 11, None, len(job.prompt_ids), 0.0) for job in jobs]

    def close(self) -> None:
        self._engine.close() if hasattr(self._engine, "close") else None


class PrefillSide:
    """A PrefillService over the instant engine, the decode side's shm pool and reservations."""

    def __init__(self, service: PrefillService, pool: SharedPagePool) -> None:
        self.service = service
        self.layout: KVLayout = service.layout
        self._pool = pool
        self._allocator, self._leases = PageAllocator(pool.num_pages), LeaseTable(grace_s=0)
        self._receiver = ShmReceiver([pool])
        self.servicer = PrefillServicer(service)
        self.engine_ns = 0
        inner = service._engine._work

        def timed_work(engine: Any) -> bool:
            start = time.thread_time_ns()
            try:
                return inner(engine)
            finally:
                self.engine_ns += time.thread_time_ns() - start

        service._engine._work = timed_work  # the engine thread looks it up on every pass

    @classmethod
    async def start(cls, model_dir: str) -> PrefillSide:
        quiet_info_logging()
        config = PrefillWorkerConfig.build(model_dir=model_dir, device="cpu")
        service = PrefillService(config, engine_factory=lambda: _InstantEngine(_build_engine(config)))
        await service.start()
        pool = SharedPagePool.create(service.layout, 256, num_slots=8, owner_tag=f"ftbench{os.getpid()}")
        return cls(service, pool)

    async def close(self) -> None:
        await self.service.stop()
        self._pool.close()
        self._pool.unlink()

    def reserve(self, request_id: str, tokens: int) -> Destination:
        pages = self._allocator.allocate(self.layout.pages_for_tokens(tokens))
        return self._receiver.expect(self._leases.grant(request_id, pages, 60), tokens)

    def release(self, destination: Destination) -> None:
        self._receiver.cancel(destination.request_id)
        self._leases.release(destination.lease_id)
        self._allocator.free(list(destination.page_ids))

    def request(self, prompt: list[int], destination: Destination) -> worker_pb2.PrefillRequest:
        sampling = sampling_to_proto(SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True))
        return worker_pb2.PrefillRequest(request_id=destination.request_id, token_ids=prompt, sampling=sampling,
                                         destination=destination.to_proto())

    async def prefill_once(self, prompt: list[int], clock: Callable[[], int]) -> tuple[int, int]:
        """(CPU ns of one stream request message up to its reply message by `clock`, engine thread ns of it);
        the record is written and the lease released after, untimed."""
        destination = self.reserve(f"p-{uuid.uuid4().hex[:12]}", len(prompt))
        data = worker_pb2.PrefillStreamRequest(request=self.request(prompt, destination)).SerializeToString()
        reply_sent, engine_before = asyncio.Event(), self.engine_ns
        start = clock()
        message = worker_pb2.PrefillStreamRequest.FromString(data)
        response = await self.servicer._prefill(message.request, reply_sent)
        worker_pb2.PrefillStreamResponse(request_id=message.request.request_id, response=response).SerializeToString()
        spent = clock() - start
        engine_ns = self.engine_ns - engine_before
        reply_sent.set()
        while self.service._jobs:
            await asyncio.sleep(0)
        self.release(destination)
        return spent, engine_ns

    def pieces(self, prompt: list[int]) -> dict[str, Piece]:
        standing = self.reserve("p-fixed", len(prompt))
        message = self.request(prompt, standing)
        data = message.SerializeToString()
        service = self.service
        params = SamplingParams(**sampling_fields(message.sampling))
        response = worker_pb2.PrefillResponse(first_token=11, num_prompt_tokens=len(prompt),
                                              timing=worker_pb2.PrefillTiming(queue_ms=0.1, prefill_ms=30.0))

        async def whole(clock: Callable[[], int]) -> int:
            return (await self.prefill_once(prompt, clock))[0]

        async def engine_part() -> int:
            return (await self.prefill_once(prompt, time.thread_time_ns))[1]

        return {
            "prefill: PrefillRequest.FromString": sync_piece(lambda: worker_pb2.PrefillRequest.FromString(data)),
            "prefill: sampling -> SamplingParams": sync_piece(lambda: SamplingParams(**sampling_fields(message.sampling))),
            "prefill: KVDestination -> Destination": sync_piece(lambda: Destination.from_proto(message.destination)),
            "prefill: PrefillService._check": sync_piece(lambda: service._check("p-fixed", prompt, params, standing)),
            "prefill: PrefillResponse build + serialise": sync_piece(lambda: worker_pb2.PrefillResponse(
                first_token=11, num_prompt_tokens=len(prompt), timing=response.timing).SerializeToString()),
            "prefill: stream message to reply, loop thread (thread CPU)": lambda: whole(time.thread_time_ns),
            "prefill: stream message to reply, both threads (process CPU)": lambda: whole(time.process_time_ns),
            "prefill: engine thread _work, forward excluded": engine_part,
        }
