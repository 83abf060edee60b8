"""The decode worker's reservation book: which request holds which pages (and state slot) under which
lease, from Reserve until Decode claims it, Release frees it or the sweeper expires it.

Reservations are allocated by `allocate_admitted` under the engine's pool lock (the stepping thread takes
that lock only while it schedules, never across a forward): on the engine process's command thread
(decode_worker/engine_process.py), or on the event loop of a test that runs the engine on a thread of its own.
Either way a Reserve is answered without waiting for the engine step in progress. Every path that ends a reservation
gives its pages and slot back exactly once: whoever removes the lease from the LeaseTable frees it.

Page-exhaustion policy: a reservation keeps `headroom_pages` free for the running requests to grow (one
speculative block each), and as much for every unclaimed standing lease (a request that will run without
passing admission again), and is refused with ResourceExhausted instead of eating into them."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Protocol

from decode_worker.admission import admits, fits_ever, headroom
from decode_worker.config import DecodeWorkerConfig
from decode_worker.engine_api import DecodeEngine, EngineFigures
from engine.cache.prefix_cache import PrefixHit
from engine.runtime.reserved_prompts import PromptReservation, ReservedHit
from kvtransfer.destination import Destination, TransportKind
from kvtransfer.errors import LeaseExpired, UnknownTransfer
from kvtransfer.leases import Lease, LeaseTable
from kvtransfer.transport import KVReceiver
from rpc.status import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted

logger = logging.getLogger(__name__)


class PagePort(Protocol):
    """Where reservations are allocated and freed (of engine_api.EnginePort)."""

    async def allocate(self, num_tokens: int, pending: int = 0,
                       prompt_ids: list[int] | None = None) -> PromptReservation: ...

    def free(self, page_ids: list[int], state_slot: int | None, checkpoint: int | None = None) -> None: ...


def allocate_admitted(engine: DecodeEngine, num_tokens: int, spec_block_size: int, pending: int = 0,
                      prompt_ids: list[int] | None = None) -> PromptReservation:
    """The prompt's pages and, for a model with linear attention, its state slot: admission and allocation
    under the engine's pool lock, so what was counted free is what gets taken. pending: requests that hold
    pages but are not running yet and will (unclaimed standing leases): their growth is kept free too.
    prompt_ids: look the prompt up in the engine's prefix cache first; the hit's pages (referenced, so they
    cannot be evicted while the lease lives) are not allocated again, only the rest is admitted and allocated.
    Raises ResourceExhausted, holding nothing."""
    page_size = engine.config.page_size
    with engine.pool_lock:
        hit = engine.match_prompt(prompt_ids) if prompt_ids else PrefixHit([], [], None)
        cached_tokens = len(hit.pages) * page_size
        try:
            growing = engine.num_running + pending
            if not admits(engine.num_free_pages, num_tokens - cached_tokens, growing, spec_block_size, page_size):
                raise ResourceExhausted(
                    f"decode pool full: {engine.num_free_pages} pages free, "
                    f"{headroom(growing, spec_block_size, page_size)} kept for running and standing requests"
                )
            if engine.num_state_slots and not engine.num_free_state_slots:
                raise ResourceExhausted(f"decode state slots full: all {engine.num_state_slots} are in use or leased")
            pages, slot = engine.allocate_reservation(num_tokens - cached_tokens)
        except BaseException:
            if hit.pages:
                engine.free_reservation(hit.pages, None)
            if hit.checkpoint is not None:
                engine.unpin_checkpoint(hit.checkpoint)
            raise
        return PromptReservation(hit.pages + pages, slot,
                                 ReservedHit(len(hit.pages), hit.checkpoint, hit.checkpoint_pages))


def free_lease(engine: DecodeEngine, page_ids: list[int], state_slot: int | None, checkpoint: int | None) -> None:
    """Gives back what allocate_admitted took (a lease's pages, slot and checkpoint pin), under the pool lock."""
    with engine.pool_lock:
        engine.free_reservation(page_ids, state_slot)
        if checkpoint is not None:
            engine.unpin_checkpoint(checkpoint)


@dataclass
class Reservation:
    lease: Lease
    receiver: KVReceiver
    num_prompt_tokens: int
    claimed: bool = False  # Decode took the lease: the pages are the running request's (or the engine's)
    standing: bool = False  # granted before its request existed: any prompt of <= num_prompt_tokens may claim it


class ReservationBook:
    """engine: an LLMEngine or a process port's EngineView (limits: context, pool size, page size); pages:
    where reservations are allocated; receivers: {transport: KVReceiver}. Event-loop only."""

    def __init__(self, config: DecodeWorkerConfig, engine: EngineFigures, receivers: Mapping[TransportKind, KVReceiver],
                 pages: PagePort) -> None:
        self.config = config
        self._engine = engine
        self._pages = pages
        self._receivers = receivers
        self._leases = LeaseTable(grace_s=config.lease_grace_s)
        self._held: dict[str, Reservation] = {}  # request id -> its reservation, until its stream ends
        self.granted = 0  # requests admitted since start: reservations, and standing leases once claimed
        self.expiries = 0  # leases freed because nobody claimed them in time
        self.cached_tokens = 0  # prompt tokens reservations found in the engine's prefix cache (not written again)
        self.local_prefills = 0  # claims prefilled on this worker (DecodeRequest.prefill_locally)

    def get(self, request_id: str) -> Reservation | None:
        return self._held.get(request_id)

    def unclaimed(self, standing: bool = False) -> list[Lease]:
        """The leases no Decode claimed yet; standing: only the standing ones (spares)."""
        return [held.lease for held in self._held.values() if not held.claimed and (held.standing or not standing)]

    # --- Reserve ------------------------------------------------------------------------------------
    async def reserve(self, request_id: str, num_prompt_tokens: int, max_new_tokens: int, transport: TransportKind,
                      ttl_s: float | None = None, standing: bool = False,
                      prompt_ids: list[int] | None = None) -> Destination:
        """Leases the prompt's pages. ttl_s: how long the lease may stay unclaimed (the caller's deadline;
        None: the configured lease_ttl_s, which also caps it). standing: a lease for a request yet to come,
        claimed by a prompt of at most num_prompt_tokens tokens (shm only: its receiver narrows the
        destination). The only await is the allocation (none at all on a thread port): everything after it
        runs in one go. prompt_ids (not for a standing lease): the prompt, looked up in the engine's prefix cache;
        the lease then holds the hit's pages too and the destination names only the pages after them."""
        config = self.config
        if not request_id:
            raise InvalidArgument("request_id", "is empty")
        if request_id in self._held:
            raise AlreadyExists(f"request {request_id} already holds a reservation on this worker")
        if num_prompt_tokens <= 0 or max_new_tokens <= 0:
            raise InvalidArgument("num_prompt_tokens", "prompt and max_new_tokens must be positive")
        if prompt_ids and (standing or len(prompt_ids) != num_prompt_tokens):
            raise InvalidArgument("prompt_token_ids", "a standing lease takes no prompt" if standing else
                                  f"{len(prompt_ids)} ids for a prompt of {num_prompt_tokens} tokens")
        self._check_fits(num_prompt_tokens, max_new_tokens)
        receiver = self._receivers.get(transport)
        if receiver is None:
            raise FailedPrecondition(f"transport {TransportKind(transport).name} is not served by this decode worker")
        if standing and transport != TransportKind.SHM:
            raise FailedPrecondition(f"standing leases travel by shm only, not {TransportKind(transport).name}")
        ttl = config.lease_ttl_s if ttl_s is None else min(config.lease_ttl_s, max(ttl_s, 0.001))
        # An unclaimed standing lease becomes a running request the moment a prompt claims it (no admission
        # then): its growth headroom is kept from every later reservation, as a running request's is.
        standing_pending = len(self.unclaimed(standing=True))
        page_ids, slot, hit = await self._pages.allocate(num_prompt_tokens, standing_pending, prompt_ids or None)
        if request_id in self._held:  # a second Reserve of the id won the race while this one allocated
            self._pages.free(page_ids, slot, hit.checkpoint)
            raise AlreadyExists(f"request {request_id} already holds a reservation on this worker")
        lease = self._leases.grant(request_id, page_ids, ttl, slot, *hit)
        try:
            destination = receiver.expect(lease, num_prompt_tokens)
        except BaseException:
            self._leases.release(lease.lease_id)
            self._free(lease)
            raise
        self._held[request_id] = Reservation(lease, receiver, num_prompt_tokens, standing=standing)
        self.granted += not standing  # a spare counts once a request claims it
        self.cached_tokens += destination.cached_tokens
        return destination

    def _free(self, lease: Lease) -> None:
        """Every reference the lease holds, given back once: its pages (cached and new), slot and checkpoint pin."""
        self._pages.free(list(lease.page_ids), lease.state_slot, lease.checkpoint)

    # --- Decode claims, Release, expiry -------------------------------------------------------------
    def claim(self, request_id: str, lease_id: str, num_prompt_tokens: int, max_new_tokens: int = 1) -> Reservation:
        """Decode takes the lease: its pages are then the caller's (hand them to the engine or drop them).
        A standing lease is narrowed to the prompt: the pages past it go back to the pool."""
        held = self._held.get(request_id)
        if held is None or held.lease.lease_id != lease_id:
            raise NotFound(f"no reservation {lease_id!r} for request {request_id}")
        if held.claimed:
            raise AlreadyExists(f"request {request_id} is already decoding")
        if held.standing:
            if not 0 < num_prompt_tokens <= held.num_prompt_tokens:
                raise InvalidArgument("token_ids", f"the standing lease holds {held.num_prompt_tokens} prompt tokens, "
                                      f"got {num_prompt_tokens}")
            self._check_fits(num_prompt_tokens, max_new_tokens)
        elif num_prompt_tokens != held.num_prompt_tokens:
            raise InvalidArgument("token_ids", f"the reservation is for {held.num_prompt_tokens} prompt tokens, "
                                  f"got {num_prompt_tokens}")
        try:
            self._leases.claim(lease_id)
        except (UnknownTransfer, LeaseExpired) as error:
            self.drop(request_id, free=isinstance(error, LeaseExpired))
            raise FailedPrecondition(f"lease of request {request_id}: {error}") from error
        held.claimed = True
        self.granted += held.standing
        if num_prompt_tokens < held.num_prompt_tokens:
            keep = len(held.receiver.narrow(request_id, num_prompt_tokens).page_ids)
            self._pages.free(list(held.lease.page_ids[keep:]), None)
            held.lease = replace(held.lease, page_ids=held.lease.page_ids[:keep])
            held.num_prompt_tokens = num_prompt_tokens
        return held

    def _check_fits(self, num_prompt_tokens: int, max_new_tokens: int) -> None:
        """The request fits the model's context and could ever fit the pool (Reserve, and the prompt that
        claims a standing lease)."""
        max_context = self._engine.model_config.max_position_embeddings
        if num_prompt_tokens + max_new_tokens > max_context:
            raise InvalidArgument("max_new_tokens", f"prompt + max_new_tokens exceeds the model context {max_context}")
        total_pages = self._engine.allocator.num_pages
        if not fits_ever(num_prompt_tokens, max_new_tokens, self.config.spec_block_size,
                         self._engine.config.page_size, total_pages):
            raise InvalidArgument("max_new_tokens", f"the request could never fit the pool of {total_pages} pages")

    def drop(self, request_id: str, free: bool) -> None:
        """Forgets a request that never reached the engine; free: its pages go back to the pool."""
        held = self._held.pop(request_id, None)
        if held is None:
            return
        held.receiver.cancel(request_id)
        if free:
            self._free(held.lease)

    def forget(self, request_id: str) -> None:
        """The request's stream ended: the engine freed (or frees) its pages; the id may be reserved again."""
        self._held.pop(request_id, None)

    def release_unclaimed(self, request_id: str, lease_id: str | None = None) -> bool:
        """Frees an unclaimed lease (of lease_id, when given) at once; False if there is none."""
        held = self._held.get(request_id)
        if held is None or held.claimed or lease_id not in (None, held.lease.lease_id):
            return False
        if self._leases.release(held.lease.lease_id) is not None:
            self.drop(request_id, free=True)
        return True

    async def sweep(self) -> None:
        """Runs until cancelled: frees the leases nobody claimed in time."""
        while True:
            await asyncio.sleep(self.config.lease_sweep_interval_s)
            for lease in self._leases.expire():
                self.expiries += 1
                held = self._held.get(lease.request_id)
                logger.warning("lease of request %s expired unclaimed; freeing %d pages", lease.request_id,
                               len(lease.page_ids))
                if held is not None and held.lease.lease_id == lease.lease_id:
                    self.drop(lease.request_id, free=True)
                else:
                    self._free(lease)
