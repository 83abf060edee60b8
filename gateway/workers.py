"""The gateway's view of its workers (worker_clients.py: one channel and stream per worker): load polling,
health, the index of their prefix caches (kv_index.py, fed by kv_watch.py), routing (router.py: by load, and by
uncached prompt tokens when the cache routing weight is > 0), and the Reserve call with its retry policy."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import grpc

from gateway.config import GatewayConfig
from gateway.kv_index import KVIndex, Overlap, PromptKeys
from gateway.kv_watch import KVWatch
from gateway.liveness import DecodeLiveness
from gateway.migration import Migrations
from gateway.router import DecodeLoad, DecodeRouter, PrefillLoad, PrefillRouter
from gateway.standing_leases import StandingLeases
from gateway.transport_choice import Placement, choose_transport
from gateway.worker_clients import DecodeWorker, PrefillWorker, connect_decode, connect_prefill
from gateway.worker_stream import rpc_error
from rpc.internal.v1 import kv_pb2, worker_pb2
from rpc.interceptors import token_metadata
from rpc.logging_setup import request_metadata
from rpc.status import ResourceExhausted, Unavailable

logger = logging.getLogger(__name__)
TRANSPORT_VALUES = {"shm": kv_pb2.TRANSPORT_SHM, "grpc": kv_pb2.TRANSPORT_GRPC, "device": kv_pb2.TRANSPORT_DEVICE}
# Reserve failures after which the worker may still hold a reservation for the request.
_UNKNOWN_OUTCOME = frozenset({grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED})


def remaining(deadline: float | None, floor: float = 0.001) -> float | None:
    """Seconds left until a time.monotonic() deadline (None: no deadline)."""
    return None if deadline is None else max(floor, deadline - time.monotonic())


class WorkerPool:
    def __init__(self, config: GatewayConfig, on_health: Callable[[bool], None] | None = None) -> None:
        self.config = config
        self.metadata = token_metadata(config.internal_token)  # sent with every call to a worker
        self.prefill = [connect_prefill(address, self.metadata) for address in config.prefill]
        self.decode = [connect_decode(address, self.metadata) for address in config.decode]
        self._prefill_router = PrefillRouter()
        self._decode_router = DecodeRouter()
        self._on_health = on_health
        self.liveness = DecodeLiveness(config.liveness)
        self.migrations = Migrations(config.migration)
        self._poller: asyncio.Task[None] | None = None
        self.healthy = False
        self.polled = asyncio.Event()  # set after the first polling round
        self.standing = (StandingLeases(self, config.standing_lease_tokens, config.standing_lease_ttl_s)
                         if config.standing_lease_tokens else None)
        self.kv_index = KVIndex()
        self.kv_watch = KVWatch(self.kv_index, [(w.load.address, w.channel) for w in (*self.prefill, *self.decode)],
                                self.metadata)

    # --- polling and health -------------------------------------------------------------------------
    def start(self) -> None:
        self._poller = asyncio.create_task(self._poll_forever())
        self.kv_watch.start()
        if self.standing is not None:
            self.standing.start()

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
        await self.kv_watch.close()
        if self.standing is not None:
            await self.standing.close()
        for worker in (*self.prefill, *self.decode):
            await worker.stream.close()
        for worker in (*self.prefill, *self.decode):
            await worker.channel.close()

    async def _poll_forever(self) -> None:
        while True:
            await self.poll_once()
            await asyncio.sleep(self.config.load_poll_interval_s)

    async def poll_once(self) -> None:
        timeout = self.config.worker_timeout_s

        async def prefill(worker: PrefillWorker) -> None:
            try:
                load = await worker.stub.GetPrefillLoad(worker_pb2.GetPrefillLoadRequest(), timeout=timeout, metadata=self.metadata)
                worker.load.placement = Placement(load.placement.node_id, device=load.placement.device)
                self._mark(worker.load, True)
            except grpc.aio.AioRpcError as error:
                self._mark(worker.load, False, error)

        async def decode(worker: DecodeWorker) -> None:
            try:
                load = await worker.stub.GetDecodeLoad(worker_pb2.GetDecodeLoadRequest(), timeout=timeout, metadata=self.metadata)
            except grpc.aio.AioRpcError as error:
                self._mark(worker.load, False, error)
                self.liveness.probed(worker, answered=False)
                return
            self.liveness.probed(worker, answered=True)
            worker.load.polled(load.free_pages - load.headroom_pages, load.total_pages, load.running, load.page_size,
                               load.free_state_slots if load.total_state_slots else None,
                               Placement(load.placement.node_id, kv_pool=load.placement.kv_pool), load.standing_pages)
            self._mark(worker.load, True)

        await asyncio.gather(*map(prefill, self.prefill), *map(decode, self.decode))
        self._update_health()
        self.polled.set()

    def _mark(self, load: PrefillLoad | DecodeLoad, healthy: bool, error: grpc.aio.AioRpcError | None = None) -> None:
        if load.healthy != healthy:
            if healthy:
                logger.info("worker %s is reachable", load.address)
            else:
                logger.warning("worker %s is unreachable: %s", load.address, error.code().name if error else "?")
        load.healthy = healthy

    def mark_unreachable(self, load: PrefillLoad | DecodeLoad, error: grpc.aio.AioRpcError) -> None:
        self._mark(load, False, error)
        self._update_health()

    def _update_health(self) -> None:
        """SERVING while at least one prefill and one decode worker answer (requests are routed to those)."""
        healthy = any(w.load.healthy for w in self.prefill) and any(w.load.healthy for w in self.decode)
        if healthy != self.healthy:
            self.healthy = healthy
            if self._on_health is not None:
                self._on_health(healthy)

    # --- routing ------------------------------------------------------------------------------------
    def overlap(self, address: str, prompt: PromptKeys | None) -> Overlap:
        """What the worker at `address` holds of the prompt, as the KV index knows it."""
        return self.kv_index.overlap(address, prompt) if prompt is not None else Overlap()

    def _decode_order(self, num_tokens: int, prompt: PromptKeys | None) -> list[int]:
        loads = [w.load for w in self.decode]
        weights = self.config.cache_weights
        if prompt is None or not weights.weight:
            return self._decode_router.rank(loads, num_tokens)
        uncached = [num_tokens - self.overlap(load.address, prompt).page_tokens for load in loads]
        return self._decode_router.rank(loads, num_tokens, uncached, weights)

    def pick_prefill(self, prompt: PromptKeys | None = None) -> PrefillWorker:
        """The prefill worker the router ranks first (by load; with the prompt's keys and a cache routing weight,
        by uncached prompt tokens against load)."""
        loads = [w.load for w in self.prefill]
        weights = self.config.cache_weights
        if prompt is None or not weights.weight:
            order = self._prefill_router.rank(loads)
        else:
            total = len(prompt.token_ids)
            uncached = [total - self.overlap(load.address, prompt).lookup_tokens for load in loads]
            sizes = [self.kv_index.cache_of(load.address) for load in loads]
            page_size = next((cache.page_size for cache in sizes if cache is not None and cache.page_size), 16)
            order = self._prefill_router.rank(loads, uncached, weights, page_size)
        if not order:
            raise Unavailable("no reachable prefill worker")
        return self.prefill[order[0]]

    def _metadata_for(self, trace_id: str) -> tuple[tuple[str, str], ...]:
        """x-request-id (names the request in the worker's log) and the internal token, if any."""
        return request_metadata(trace_id) + self.metadata

    @staticmethod
    async def _reserve_answer(worker: DecodeWorker,
                              call: asyncio.Future[worker_pb2.ReserveResponse]) -> worker_pb2.ReserveResponse:
        """The Reserve's answer; UNAVAILABLE when hang detection takes the worker for hung first (gateway/
        liveness.py): the call is cancelled (a stopped worker would hold it until it resumes; the worker frees a
        reservation whose answer was lost). The caller's cancellation leaves the call running (_undo_reserve)."""
        hang = worker.stream.hang_signal()
        try:
            await asyncio.wait((call, hang), return_when=asyncio.FIRST_COMPLETED)
        finally:
            worker.stream.drop_hang_signal(hang)
        if call.done():
            return call.result()
        call.cancel()
        raise rpc_error(grpc.StatusCode.UNAVAILABLE, hang.result())

    async def _undo_reserve(self, worker: DecodeWorker, call: asyncio.Future[worker_pb2.ReserveResponse], request_id: str,
                            trace_id: str) -> None:
        """The request was cancelled while its Reserve was in flight: let the call finish (a Release sent
        before it lands would miss it), then release what it reserved."""
        try:
            await asyncio.wait_for(call, self.config.cleanup_timeout_s)
        except grpc.aio.AioRpcError as error:
            if error.code() not in _UNKNOWN_OUTCOME:
                return  # refused: nothing reserved
        except asyncio.TimeoutError:
            pass
        await self._release(worker, request_id, trace_id)

    async def _release(self, worker: DecodeWorker, request_id: str, trace_id: str) -> None:
        """Release of a reservation whose outcome is unknown to us (the worker also frees a Reserve it
        is still allocating, and one whose answer it could not deliver)."""
        try:
            await worker.stub.Release(worker_pb2.ReleaseRequest(request_id=request_id), timeout=self.config.cleanup_timeout_s,
                                     metadata=self._metadata_for(trace_id))
        except grpc.aio.AioRpcError as error:
            logger.warning("could not release the reservation of request %s: %s", request_id, error.code().name)

    async def release_quietly(self, worker: DecodeWorker, request_id: str, trace_id: str) -> None:
        """Release on a worker that may be dead or hung (a migrated request's old reservation): best effort."""
        try:
            await worker.stub.Release(worker_pb2.ReleaseRequest(request_id=request_id),
                                      timeout=self.config.cleanup_timeout_s, metadata=self._metadata_for(trace_id))
        except grpc.aio.AioRpcError:
            pass  # dead: its pool is gone; hung: it aborts the request when it sees its stream cancelled

    def prefill_placement(self) -> Placement | None:
        """Where the prefill side of a request will be: the placement every reachable prefill worker shares
        (the worker itself is picked after Reserve, by load), or None when they differ (auto then takes grpc,
        which works from any of them)."""
        placements = {w.load.placement for w in self.prefill if w.load.healthy}
        return placements.pop() if len(placements) == 1 else None

    def transport_for(self, decode: DecodeWorker) -> int:
        """The Transport of a request reserved on `decode` (gateway/transport_choice.py)."""
        return TRANSPORT_VALUES[choose_transport(self.config.transport, self.prefill_placement(), decode.load.placement)]

    def take_standing(self, num_prompt_tokens: int,
                      prompt: PromptKeys | None = None) -> tuple[DecodeWorker, kv_pb2.KVDestination] | None:
        """A standing lease (gateway/standing_leases.py) for the prompt, on the decode worker the router ranks
        first if it holds one, or None: Reserve as usual - also when the KV index says that worker holds part of the
        prompt (a spare takes no decode-side lookup). The destination names the spare's request id: run under it."""
        if self.standing is None:
            return None
        order = self._decode_order(num_prompt_tokens, prompt)
        if order and self.overlap(self.decode[order[0]].load.address, prompt).page_tokens:
            return None  # that worker holds part of the prompt: a Reserve maps it (a spare would not look it up)
        return self.standing.take(num_prompt_tokens, order)

    def refill_standing(self) -> None:
        """A run that took a standing lease has sent its first token on: refill the spare now (standing_leases.py)."""
        if self.standing is not None:
            self.standing.refill_soon()

    async def reserve(self, request_id: str, num_prompt_tokens: int, max_new_tokens: int,
                      deadline: float | None, trace_id: str | None = None,
                      prompt: PromptKeys | None = None) -> tuple[DecodeWorker, kv_pb2.KVDestination]:
        """Reserve on the best decode worker, with the transport chosen for it; on RESOURCE_EXHAUSTED tries the
        others, then waits and retries until the admission timeout (or the request's deadline). trace_id:
        the x-request-id to send (default: request_id); prompt: its token ids and page keys (cache-aware ranking,
        and sent for the decode worker's prefix-cache lookup: the destination's cached_tokens / checkpoint_tokens
        say what it holds)."""
        trace_id = trace_id or request_id
        give_up = time.monotonic() + self.config.admission_timeout_s
        if deadline is not None:
            give_up = min(give_up, deadline)
        backoff, last = 0.005, "no decode worker"
        while True:
            order = self._decode_order(num_prompt_tokens, prompt)
            if not order:
                raise Unavailable("no reachable decode worker")
            for index in order:
                worker = self.decode[index]
                request = worker_pb2.ReserveRequest(request_id=request_id, num_prompt_tokens=num_prompt_tokens,
                                                    max_new_tokens=max_new_tokens, transport=self.transport_for(worker),
                                                    prompt_token_ids=prompt.token_ids if prompt is not None else ())
                call = asyncio.ensure_future(worker.stub.Reserve(request, timeout=remaining(deadline),
                                                                  metadata=self._metadata_for(trace_id)))
                claimed = worker.load.claim(num_prompt_tokens + 1)
                try:
                    destination = (await self._reserve_answer(worker, call)).destination
                except asyncio.CancelledError:
                    worker.load.unclaim(claimed)
                    await self._undo_reserve(worker, call, request_id, trace_id)
                    raise
                except grpc.aio.AioRpcError as error:
                    worker.load.unclaim(claimed)
                    if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                        last = error.details() or "full"
                        worker.load.full()
                        if self.standing is not None:
                            self.standing.give_back(worker)
                        continue
                    if error.code() == grpc.StatusCode.UNAVAILABLE:
                        self.mark_unreachable(worker.load, error)
                        continue
                    if error.code() in _UNKNOWN_OUTCOME:  # it may have reserved just as the deadline fired
                        await self._release(worker, request_id, trace_id)
                    raise
                worker.load.granted(claimed, len(destination.page_ids))
                return worker, destination
            if time.monotonic() >= give_up:
                raise ResourceExhausted(f"no decode worker has room for the request: {last}")
            await asyncio.sleep(min(backoff, max(0.0, give_up - time.monotonic())))
            backoff = min(backoff * 2, 0.1)

