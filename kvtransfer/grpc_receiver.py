"""PushReceiver: the decode side of the gRPC transport, without gRPC (grpc_servicer.py is the thin servicer).

It keeps the requests decode expects; each Push stream is a grpc_session.PushSession writing one rank's
pages. A failure on any stream fails the whole request (every rank), calls on_failed(request_id) once,
and later chunks of other streams for it are refused; admit() raises the error.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

from engine.cache.kv_cache import PagedLatentCache
from kvtransfer.destination import Destination, TransportKind
from kvtransfer.errors import BadChunk, KVTransferError, LayoutMismatch, TransferAborted, TransferTimeout, UnknownTransfer
from kvtransfer.grpc_session import PendingPush, PushSession
from kvtransfer.leases import Lease, cached_extents
from kvtransfer.page_spans import cache_view
from kvtransfer.transport import KVReceiver, TransferResult

logger = logging.getLogger(__name__)
_RECENT_FAILURES = 1024  # failed / cancelled requests remembered for late pushes and admit()
_T = TypeVar("_T")


class PushReceiver(KVReceiver):
    """caches[r]: decode rank r's pool (an shm pool's .cache, or any PagedLatentCache over a flat buffer).
    addresses[r]: the address prefill must push rank r's pages to (set once the server is listening)."""

    transport = TransportKind.GRPC

    def __init__(self, caches: Sequence[PagedLatentCache], addresses: Sequence[str] = (), *,
                 on_failed: Callable[[str], None] | None = None) -> None:
        views = [cache_view(cache) for cache in caches]
        if not views or any(view[:2] != views[0][:2] for view in views):
            raise LayoutMismatch("PushReceiver needs at least one cache, all of the same layout and size")
        self.layout, self.num_pages = views[0][0], views[0][1]
        self.num_state_slots = caches[0].shape.state.num_slots if caches[0].shape.state is not None else 0
        self._views = [view[2] for view in views]
        self.addresses = tuple(addresses)
        self.on_failed = on_failed
        self._lock = threading.Condition()
        self._requests: dict[str, PendingPush] = {}
        self._failures: dict[str, KVTransferError] = {}
        self._cancelled: dict[str, Destination] = {}  # recent cancels: a late push learns if its lease expired

    def advertise(self, addresses: Sequence[str]) -> None:
        if len(addresses) != len(self._views):
            raise ValueError(f"need one address per rank ({len(self._views)})")
        self.addresses = tuple(addresses)

    # --- KVReceiver -----------------------------------------------------------------------------------
    def expect(self, lease: Lease, num_tokens: int) -> Destination:
        if len(self.addresses) != len(self._views):
            raise ValueError("PushReceiver.advertise(addresses) must be called before expect()")
        destination = Destination(
            transport=self.transport, layout_hash=self.layout.hash, request_id=lease.request_id,
            lease_id=lease.lease_id, page_ids=lease.written_page_ids, targets=self.addresses,
            lease_deadline_unix_ms=lease.deadline_unix_ms, num_tokens=num_tokens, pool_num_pages=self.num_pages,
            state_slot=lease.state_slot, **cached_extents(lease, self.layout.page_size),
        )
        destination.check_against(self.layout, "PushReceiver.expect")
        if max(lease.page_ids) >= self.num_pages:
            raise ValueError(f"page {max(lease.page_ids)} outside the pool of {self.num_pages} pages")
        if lease.state_slot is not None and lease.state_slot >= self.num_state_slots:
            raise ValueError(f"state slot {lease.state_slot} outside the pool of {self.num_state_slots} slots")
        with self._lock:
            if lease.request_id in self._requests:
                raise ValueError(f"request {lease.request_id} is already expected")
            self._requests[lease.request_id] = PendingPush(destination, len(self._views))
            self._failures.pop(lease.request_id, None)
            self._cancelled.pop(lease.request_id, None)
        return destination

    def admit(self, request_id: str, timeout_s: float = 0.0) -> TransferResult:
        with self._lock:
            request = self._requests.get(request_id)
            if request is None:
                raise self._failures.pop(request_id, None) or UnknownTransfer(f"no KV transfer expected for {request_id}")
            complete = lambda: request.error is not None or len(request.done_ranks) == request.num_ranks  # noqa: E731
            if not self._lock.wait_for(complete, timeout=timeout_s):
                raise TransferTimeout(f"KV of request {request_id} not complete after {timeout_s:.3f} s")
            if request.error is not None:
                self._failures.pop(request_id, None)
                raise request.error
            del self._requests[request_id]
        return TransferResult(request_id, request.bytes, 0, request.num_ranks)

    def admit_now(self, request_id: str, max_verify_bytes: int) -> TransferResult | None:
        """Every rank's push has finished (each chunk was checked as it came): nothing left to verify."""
        with self._lock:
            request = self._requests.get(request_id)
            if request is not None and request.error is None and len(request.done_ranks) < request.num_ranks:
                return None
        return self.admit(request_id)

    def cancel(self, request_id: str) -> None:
        with self._lock:
            request = self._requests.pop(request_id, None)
            if request is not None:
                request.set_error(TransferAborted(f"request {request_id} was cancelled"))
                _remember(self._cancelled, request_id, request.destination)
            self._failures.pop(request_id, None)
            self._lock.notify_all()

    def open_stream(self) -> PushSession:
        return PushSession(self)

    # --- used by sessions -----------------------------------------------------------------------------
    def view(self, rank: int) -> memoryview:
        """Bytes of rank's page region."""
        return self._views[rank]

    def lookup(self, request_id: str, lease_id: str) -> PendingPush:
        with self._lock:
            request = self._requests.get(request_id)
            ended = self._cancelled.get(request_id)
        if ended is not None and ended.lease_id == lease_id:  # expect() of the id again forgets it
            ended.check_lease()  # freed because the lease ran out (the sweeper): say so, not "unknown"
        if request is None or request.destination.lease_id != lease_id:
            raise UnknownTransfer(f"no KV transfer expected for request {request_id!r} under lease {lease_id!r}")
        return request

    def open_rank(self, request: PendingPush, rank: int) -> None:
        if not 0 <= rank < request.num_ranks:
            raise BadChunk(f"rank {rank} out of range (decode has {request.num_ranks})")
        with self._lock:
            if rank in request.open_ranks or rank in request.done_ranks:
                raise BadChunk(f"a second Push for request {request.destination.request_id} rank {rank}")
            request.open_ranks.add(rank)

    def close_rank(self, request: PendingPush, rank: int, nbytes: int) -> None:
        with self._lock:
            if request.error is not None:
                raise TransferAborted(f"request {request.destination.request_id} already failed: {request.error}")
            request.open_ranks.discard(rank)
            request.done_ranks.add(rank)
            request.bytes += nbytes
            self._lock.notify_all()

    def fail(self, request: PendingPush, error: KVTransferError) -> None:
        """Fails the request (first error wins): forgotten here, admit() raises error, on_failed is called."""
        with self._lock:
            if not request.set_error(error):
                return
            request_id = request.destination.request_id
            if self._requests.get(request_id) is request:
                del self._requests[request_id]
                _remember(self._failures, request_id, error)
            self._lock.notify_all()
        logger.warning("KV push of request %s failed: %s", request.destination.request_id, error)
        if self.on_failed is not None:
            self.on_failed(request.destination.request_id)


def _remember(recent: dict[str, _T], request_id: str, value: _T) -> None:
    """Keeps value under request_id, forgetting the oldest entries beyond _RECENT_FAILURES."""
    recent.pop(request_id, None)
    recent[request_id] = value
    while len(recent) > _RECENT_FAILURES:
        recent.pop(next(iter(recent)))
