"""Standing leases: one spare reservation per decode worker, granted before a request arrives, so that a
request whose prompt fits takes it instead of paying a Reserve round trip before its prefill.

A spare is a Reserve with `standing` set for `tokens` prompt tokens under an id of its own
("standing.<hex>"); the request that takes it runs under that id on both workers (the prefill worker
checks the destination names the request it prefills), and the destination is narrowed to the prompt's
pages (Destination.narrowed: still bound to the whole lease, so the prefill worker's lease check holds).
The decode worker frees the pages past the prompt when Decode claims the lease. A spare is taken at most
once (take() removes it), only from a reachable worker whose transport is shm, and only while at least
half its lease is left; the refill task (woken once the taker's first token is out, else at its next
poll-interval pass) replaces taken, ageing and refused spares, holds off while the
worker is short of pages (and gives its spare back when a Reserve there is refused for room), and
close() releases every spare. On by default (GatewayConfig.standing_lease_tokens, 1024). Unclaimed spares show in
the decode worker's load reports as leases, and apart as standing_leases / standing_pages / standing_state_slots."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import grpc

from gateway.config import GatewayConfig
from gateway.worker_clients import DecodeWorker
from rpc.internal.v1 import kv_pb2, worker_pb2
from rpc.logging_setup import request_metadata

logger = logging.getLogger(__name__)
RETRY_S = 1.0  # after a refused spare (no room, unreachable)
REFUSED_RETRY_S = 60.0  # after a spare the worker can never grant (its context or pool is too small for it)


class SparePool(Protocol):
    """What the spares need of the worker pool (gateway/workers.WorkerPool)."""

    config: GatewayConfig
    decode: Sequence[DecodeWorker]
    polled: asyncio.Event
    metadata: tuple[tuple[str, str], ...]

    def transport_for(self, decode: DecodeWorker) -> int: ...


@dataclass(frozen=True)
class Spare:
    worker: DecodeWorker
    destination: kv_pb2.KVDestination

    @property
    def left_s(self) -> float:
        """Seconds until the lease lapses on the decode worker."""
        return self.destination.lease_deadline_unix_ms / 1000 - time.time()


def narrowed_destination(message: kv_pb2.KVDestination, num_tokens: int, page_size: int) -> kv_pb2.KVDestination:
    """kvtransfer's Destination.narrowed done on the message (no round trip through the domain object on
    the first token's path): the first ceil(num_tokens / page_size) pages, still bound to the whole lease
    (lease_page_ids / lease_num_tokens: the lease as granted)."""
    if not 0 < num_tokens <= message.num_tokens:
        raise ValueError(f"cannot narrow a destination of {message.num_tokens} tokens to {num_tokens}")
    narrowed = kv_pb2.KVDestination()
    narrowed.CopyFrom(message)
    if not message.lease_page_ids:
        narrowed.lease_page_ids.extend(message.page_ids)
        narrowed.lease_num_tokens = message.num_tokens
    del narrowed.page_ids[-(-num_tokens // page_size):]
    narrowed.num_tokens = num_tokens
    return narrowed


class StandingLeases:
    """tokens: the prompt tokens each spare holds (longer prompts Reserve as usual); ttl_s: the lease asked
    for (the decode worker caps it at its lease TTL); a spare is used and kept while >= ttl_s / 2 is left."""

    def __init__(self, pool: SparePool, tokens: int, ttl_s: float) -> None:
        if tokens <= 0 or ttl_s <= 0:
            raise ValueError("standing lease tokens and ttl_s must be positive")
        self._pool = pool
        self.tokens = tokens
        self.ttl_s = ttl_s
        self._spares: dict[int, Spare] = {}  # decode worker index -> its spare
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._releases: set[asyncio.Task[None]] = set()
        self._retry_at: dict[int, float] = {}  # decode worker index -> when to try again after a refusal
        self.taken = 0  # spares requests took (for tests and logs)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._refill_forever())

    def held(self) -> list[Spare]:
        return list(self._spares.values())

    def take(self, num_prompt_tokens: int, order: list[int]) -> tuple[DecodeWorker, kv_pb2.KVDestination] | None:
        """The spare of the router's first choice (`order[0]`), narrowed to the prompt, or None when that worker
        holds no usable spare (then Reserve as usual, in the router's order): a spare saves a round trip but
        never decides where a request runs (a worker whose spare is being refilled would otherwise lose every
        request to one that holds a spare). Removes it: no other request can take it."""
        if num_prompt_tokens > self.tokens:
            return None
        for index in order[:1]:
            spare = self._spares.get(index)
            if spare is None or not self._usable(spare):
                continue
            del self._spares[index]
            self.taken += 1
            load = spare.worker.load
            load.spare_taken()
            return spare.worker, narrowed_destination(spare.destination, num_prompt_tokens, load.page_size)
        return None

    def refill_soon(self) -> None:
        """Wakes the refill task now rather than at its next poll-interval pass. The run that took a spare
        calls this once its first token is out, so the refill's Reserve competes with neither its prefill
        nor the first token's way to the client (a run that ends sooner leaves it to the next pass)."""
        self._wake.set()

    def give_back(self, worker: DecodeWorker) -> None:
        """A Reserve on `worker` was refused for room: release its spare so the request can have the pages."""
        for index, spare in list(self._spares.items()):
            if spare.worker is worker:
                del self._spares[index]
                self._release_soon(spare)

    async def close(self) -> None:
        """Stops refilling and releases every spare (gateway shutdown)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        spares, self._spares = list(self._spares.values()), {}
        await asyncio.gather(*(self._release(spare) for spare in spares), *self._releases)

    # --- refill -------------------------------------------------------------------------------------
    def _usable(self, spare: Spare) -> bool:
        return (spare.worker.load.healthy and spare.left_s >= self.ttl_s / 2
                and self._pool.transport_for(spare.worker) == kv_pb2.TRANSPORT_SHM)

    async def _refill_forever(self) -> None:
        await self._pool.polled.wait()
        while True:
            self._wake.clear()
            for index, worker in enumerate(self._pool.decode):
                spare = self._spares.get(index)
                if spare is not None and not self._usable(spare):
                    del self._spares[index]
                    if worker.load.healthy:
                        self._release_soon(spare)  # an unreachable worker frees it when the lease lapses
                due = time.monotonic() >= self._retry_at.get(index, 0.0)
                if index not in self._spares and due and self._has_room(worker):
                    await self._grant(index, worker)
            await self._sleep(self._pool.config.load_poll_interval_s)  # health and room change with the polls

    async def _sleep(self, seconds: float) -> None:
        """Until refill_soon() wakes the task or `seconds` pass (asyncio.wait, not wait_for: Python 3.11's
        wait_for can swallow a cancel that arrives as the event is set, and close() must stop the task)."""
        waiter = asyncio.ensure_future(self._wake.wait())
        try:
            await asyncio.wait({waiter}, timeout=seconds)
        finally:
            waiter.cancel()

    def _has_room(self, worker: DecodeWorker) -> bool:
        """Reachable, shm, and (by its last load report) room for two spares: never the last pages, nor the last
        state slot of a model with linear attention (a spare holds one)."""
        load = worker.load
        return (load.healthy and self._pool.transport_for(worker) == kv_pb2.TRANSPORT_SHM
                and load.free_pages >= 2 * load.pages_for(self.tokens)
                and (load.free_state_slots is None or load.free_state_slots >= 2))

    async def _grant(self, index: int, worker: DecodeWorker) -> None:
        request_id = f"standing.{uuid.uuid4().hex[:16]}"
        request = worker_pb2.ReserveRequest(request_id=request_id, num_prompt_tokens=self.tokens, max_new_tokens=1,
                                            transport=kv_pb2.TRANSPORT_SHM, standing=True)
        try:
            response = await worker.stub.Reserve(request, timeout=self.ttl_s, metadata=self._metadata(request_id))
        except grpc.aio.AioRpcError as error:
            never = error.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION)
            logger.log(logging.WARNING if never else logging.INFO, "no standing lease on %s: %s %s%s",
                       worker.load.address, error.code().name, error.details(),
                       f" (asking again in {REFUSED_RETRY_S:.0f} s)" if never else "")
            if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                worker.load.full()
            self._retry_at[index] = time.monotonic() + (REFUSED_RETRY_S if never else RETRY_S)
            return
        worker.load.spare_granted(len(response.destination.page_ids))
        self._spares[index] = Spare(worker, response.destination)

    def _metadata(self, request_id: str) -> tuple[tuple[str, str], ...]:
        return request_metadata(request_id) + self._pool.metadata

    def _release_soon(self, spare: Spare) -> None:
        task = asyncio.get_running_loop().create_task(self._release(spare))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _release(self, spare: Spare) -> None:
        request_id = spare.destination.request_id
        try:
            await spare.worker.stub.Release(worker_pb2.ReleaseRequest(request_id=request_id),
                                            timeout=self._pool.config.cleanup_timeout_s,
                                            metadata=self._metadata(request_id))
        except grpc.aio.AioRpcError as error:
            logger.warning("could not release standing lease %s: %s", request_id, error.code().name)
