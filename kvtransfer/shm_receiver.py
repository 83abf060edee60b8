"""ShmReceiver: the decode side of the shm (and mooncake) transports: reserve a completion slot per lease,
then admit a request only once every rank's completion record is there and its pages check out."""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtransfer.checksum import Algorithm, request_checksum
from kvtransfer.completion import CompletionRecord, SlotState
from kvtransfer.destination import Destination, TransportKind, lease_binding
from kvtransfer.errors import (
    ChecksumMismatch, IncompleteTransfer, KVTransferError, LayoutMismatch, OutOfSlots, TransferAborted,
    TransferTimeout, UnknownTransfer,
)
from kvtransfer.leases import Lease, cached_extents
from kvtransfer.shm_pool import SharedPagePool
from kvtransfer.transport import KVReceiver, TransferResult

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Pending:
    destination: Destination


class ShmReceiver(KVReceiver):
    """pools[r]: decode rank r's pool (created here, or attached when another process owns it).

    on_failed(request_id) is called once for every request that failed verification (checksum, short
    write, writer abort): the decode worker frees its pages there.
    """

    transport = TransportKind.SHM

    def __init__(
        self, pools: Sequence[SharedPagePool], *, verify_checksum: bool = True,
        on_failed: Callable[[str], None] | None = None, poll_s: float = 0.0005,
    ) -> None:
        if not pools:
            raise ValueError("ShmReceiver needs at least one pool")
        first = pools[0]
        for pool in pools[1:]:
            if (pool.layout, pool.num_pages, pool.header.num_slots) != (first.layout, first.num_pages, first.header.num_slots):
                raise LayoutMismatch("every TP rank's pool must have the same layout, page and slot count")
        self.pools = list(pools)
        self.layout = first.layout
        self.verify_checksum = verify_checksum
        self.on_failed = on_failed
        self.poll_s = poll_s
        self._lock = threading.Lock()
        self._free_slots = list(range(first.header.num_slots - 1, -1, -1))
        self._pending: dict[str, _Pending] = {}

    # --- reserve --------------------------------------------------------------------------------------
    def _destination_extras(self, slot: int) -> dict:
        return {"targets": tuple(pool.name for pool in self.pools)}

    def expect(self, lease: Lease, num_tokens: int) -> Destination:
        need = self.layout.pages_for_tokens(num_tokens)
        if need != len(lease.page_ids):
            raise ValueError(f"{num_tokens} tokens need {need} pages, the lease holds {len(lease.page_ids)}")
        written, cached = lease.written_page_ids, cached_extents(lease, self.layout.page_size)
        if self.layout.has_state != (lease.state_slot is not None):
            raise ValueError(f"the pool {'has' if self.layout.has_state else 'has no'} linear-attention state: "
                             f"the lease must {'hold' if self.layout.has_state else 'not hold'} a state slot")
        with self._lock:
            if lease.request_id in self._pending:
                raise ValueError(f"request {lease.request_id} is already expected")
            if not self._free_slots:
                raise OutOfSlots(f"all {self.pools[0].header.num_slots} completion slots are in use")
            slot = self._free_slots.pop()
            binding = lease_binding(lease.lease_id, self.transport, written, num_tokens, lease.state_slot,
                                    cached["cached_tokens"])
            base = max(pool.completions.sequence(slot) for pool in self.pools)
            for pool in self.pools:
                sequence = pool.completions.reserve(slot, lease.request_id, binding, at_least=base)
            destination = Destination(
                transport=self.transport, layout_hash=self.layout.hash, request_id=lease.request_id,
                lease_id=lease.lease_id, page_ids=written, lease_deadline_unix_ms=lease.deadline_unix_ms,
                num_tokens=num_tokens, pool_num_pages=self.pools[0].num_pages, completion_slot=slot,
                completion_sequence=sequence, state_slot=lease.state_slot, **cached, **self._destination_extras(slot),
            )
            self._pending[lease.request_id] = _Pending(destination)
        return destination

    def narrow(self, request_id: str, num_tokens: int) -> Destination:
        with self._lock:
            pending = self._pending.get(request_id)
            if pending is None:
                raise UnknownTransfer(f"no KV transfer expected for request {request_id}")
            destination = pending.destination.narrowed(num_tokens, self.layout.page_size)
            self._pending[request_id] = _Pending(destination)
        return destination

    # --- admit ----------------------------------------------------------------------------------------
    def records(self, request_id: str) -> list[CompletionRecord | None]:
        destination = self._get(request_id).destination
        return [pool.completions.read(destination.completion_slot) for pool in self.pools]

    def ready(self, request_id: str) -> bool:
        """True once every rank's writer has finished (successfully or not): admit() will not wait."""
        sequence = self._get(request_id).destination.completion_sequence
        return all(
            record is not None and record.sequence == sequence and record.state in (SlotState.COMPLETE, SlotState.FAILED)
            for record in self.records(request_id)
        )

    def admit_now(self, request_id: str, max_verify_bytes: int) -> TransferResult | None:
        """Every rank's record is there and the checksum (if verified) covers at most max_verify_bytes."""
        destination = self._get(request_id).destination
        nbytes = self.layout.request_bytes(len(destination.page_ids)) * len(self.pools)
        if (self.verify_checksum and nbytes > max_verify_bytes) or not self.ready(request_id):
            return None
        return self.admit(request_id)

    def admit(self, request_id: str, timeout_s: float = 0.0) -> TransferResult:
        destination = self._get(request_id).destination
        deadline = time.monotonic() + timeout_s
        while not self.ready(request_id):
            if time.monotonic() >= deadline:
                raise TransferTimeout(f"KV of request {request_id} not complete after {timeout_s:.3f} s")
            time.sleep(self.poll_s)
        try:
            checksum = 0
            for rank, pool in enumerate(self.pools):
                checksum = self._verify(pool, rank, destination)
        except KVTransferError as error:
            self._forget(request_id)
            logger.warning("KV of request %s failed verification: %s", request_id, error)
            if self.on_failed is not None:
                self.on_failed(request_id)
            raise
        self._forget(request_id)
        nbytes = self.layout.request_bytes(len(destination.page_ids)) * len(self.pools)
        return TransferResult(request_id, nbytes, checksum, len(self.pools))

    def _verify(self, pool: SharedPagePool, rank: int, destination: Destination) -> int:
        record = pool.completions.read(destination.completion_slot)
        where = f"request {destination.request_id} rank {rank}"
        if record is None or not record.belongs_to(destination.request_id, destination.binding):
            raise UnknownTransfer(f"{where}: completion slot holds another request's record")
        if record.state == SlotState.FAILED:
            raise TransferAborted(f"{where}: the writer aborted the transfer")
        if record.layout_hash != self.layout.hash:
            raise LayoutMismatch(f"{where}: record layout {record.layout_hash}, pool layout {self.layout.hash}")
        expected_bytes = self.layout.request_bytes(len(destination.page_ids))
        if record.bytes_written != expected_bytes or record.num_tokens != destination.num_tokens:
            raise IncompleteTransfer(
                f"{where}: short write: {record.bytes_written} of {expected_bytes} bytes, "
                f"{record.num_tokens} of {destination.num_tokens} tokens"
            )
        if self.verify_checksum:
            actual, _ = request_checksum(
                pool.data_view, self.layout, pool.num_pages, destination.page_ids, Algorithm(record.algorithm),
                destination.state_slot,
            )
            if actual != record.checksum:
                raise ChecksumMismatch(f"{where}: page checksum {actual:#x} != recorded {record.checksum:#x}")
        return record.checksum

    # --- bookkeeping ----------------------------------------------------------------------------------
    def cancel(self, request_id: str) -> None:
        self._forget(request_id)

    def _get(self, request_id: str) -> _Pending:
        with self._lock:
            pending = self._pending.get(request_id)
        if pending is None:
            raise UnknownTransfer(f"no KV transfer expected for request {request_id}")
        return pending

    def _forget(self, request_id: str) -> None:
        with self._lock:
            pending = self._pending.pop(request_id, None)
            if pending is None:
                return
            slot = pending.destination.completion_slot
            for pool in self.pools:
                pool.completions.release(slot)
            self._free_slots.append(slot)

    def __len__(self) -> int:
        with self._lock:
            return len(self._pending)
