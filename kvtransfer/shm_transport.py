"""Shared-memory transport: prefill writes pages in place into decode's mapped pool, then a completion record.

Writer (prefill): ShmWriter attaches each decode pool once (by name, layout checked). A handle writes
pages straight into the mapped pool (one memcpy from the caller's tensor, none if prefill ran its forward
into handle.cache directly: open(..., in_place=True)). Each layer is hashed as it is written, while its
bytes are still in cache, when pages arrive in order; finish() hashes the rest from the pool and writes
the completion record.
Reader (decode): kvtransfer.shm_receiver.ShmReceiver.
"""
from __future__ import annotations

import logging
import threading

import numpy as np
import torch

from kvtransfer.checksum import DEFAULT_ALGORITHM, Algorithm, Hasher, combine, spans_digest
from kvtransfer.completion import CompletionRecord, SlotState, key_of
from kvtransfer.destination import Destination, TransportKind, now_ms
from kvtransfer.errors import BadChunk, IncompleteTransfer, UnknownTransfer
from kvtransfer.layout import KVLayout, SegmentKind
from kvtransfer.page_spans import byte_view, segment_spans
from kvtransfer.shm_pool import SharedPagePool
from kvtransfer.transport import KVWriteHandle, KVWriter, TransferResult

logger = logging.getLogger(__name__)
HASH_PIECE_BYTES = 256 * 1024  # copy-then-hash granularity: small enough to stay in a core's L2


class ShmWriteHandle(KVWriteHandle):
    """One request on one rank. `cache` is the mapped pool's PagedLatentCache: prefill may write the
    reserved pages through it directly (then open with in_place=True and call finish())."""

    def __init__(
        self, pool: SharedPagePool, destination: Destination, rank: int, algorithm: Algorithm, in_place: bool
    ) -> None:
        super().__init__(destination, rank, pool.layout)
        self.pool = pool
        self.cache = pool.cache
        self.algorithm = Algorithm(algorithm)
        self.in_place = in_place
        self._segments = {segment: i for i, segment in enumerate(pool.layout.segments())}
        self._units = [destination.units(kind) for kind, _ in self._segments]  # page ids, or (STATE) the slot
        self._written = [np.zeros(len(units), dtype=bool) for units in self._units]
        self._hashers = [Hasher(self.algorithm) for _ in self._segments]
        self._next_index = [0] * len(self._segments)  # pages hashed in order so far, per segment
        self._in_order = [True] * len(self._segments)

    def write_pages(self, kind: SegmentKind, layer: int, first_index: int, data: torch.Tensor) -> None:
        self.destination.check_lease()
        self.check_data(kind, layer, first_index, data)
        segment = self._segments[(kind, layer)]
        count = data.shape[0]
        pages = self._units[segment][first_index : first_index + count]
        view = self.pool.data_view
        source = byte_view(data) if data.is_contiguous() else None
        tensor = self._tensor(kind, layer)
        hasher = self._hashers[segment]
        for span in segment_spans(self.layout, self.pool.num_pages, kind, layer, pages, first_index,
                                  self.pool.num_state_slots):
            local = span.first_index - first_index
            target = view[span.offset : span.offset + span.nbytes]
            in_order = self._in_order[segment] = self._in_order[segment] and span.first_index == self._next_index[segment]
            if source is not None:  # plain memcpy (no torch thread pool spinning between small copies), in
                start = local * self.layout.page_bytes(kind)  # pieces hashed while they are still in L2
                for begin in range(0, span.nbytes, HASH_PIECE_BYTES):
                    end = min(begin + HASH_PIECE_BYTES, span.nbytes)
                    target[begin:end] = source[start + begin : start + end]
                    if in_order:
                        hasher.update(target[begin:end])
            else:
                tensor[span.first_page : span.first_page + span.num_pages].copy_(data[local : local + span.num_pages])
                if in_order:
                    hasher.update(target)
            if in_order:
                self._next_index[segment] += span.num_pages
        self._written[segment][first_index : first_index + count] = True

    def _tensor(self, kind: SegmentKind, layer: int) -> torch.Tensor:
        """The pool tensor of a segment, indexed by page id (STATE: raw slots [num_slots, slot bytes])."""
        if kind == SegmentKind.STATE:
            return self.cache.state.raw
        return self.cache.layer(layer) if kind == SegmentKind.TARGET else self.cache.draft_layer(layer)

    def finish(self) -> TransferResult:
        if self.done:
            raise UnknownTransfer(f"request {self.destination.request_id} already finished or aborted")
        try:
            self.destination.check_lease()
            missing = [(segment, int(np.argmin(done))) for segment, done in enumerate(self._written) if not done.all()]
            if not self.in_place and missing:
                segment, index = missing[0]
                kind, layer = self.layout.segments()[segment]
                raise IncompleteTransfer(
                    f"request {self.destination.request_id}: page {index} of {kind.name.lower()} layer {layer} "
                    f"was never written ({sum(int((~done).sum()) for done in self._written)} layer-pages missing)"
                )
            checksum, nbytes = self._checksum()
        except BaseException as error:
            self.abort(f"{type(error).__name__}: {error}")
            raise
        dest = self.destination
        record = CompletionRecord(
            SlotState.COMPLETE, dest.completion_sequence, int(self.algorithm), nbytes, checksum, dest.num_tokens,
            now_ms(), self.layout.hash, key_of(dest.request_id), key_of(dest.binding),
        )
        self.done = True
        self.pool.completions.finish(dest.completion_slot, dest.completion_sequence, dest.request_id, dest.binding, record)
        return TransferResult(dest.request_id, nbytes, checksum)

    def _checksum(self) -> tuple[int, int]:
        digests, nbytes = [], 0
        for (kind, layer), segment in self._segments.items():
            units = self._units[segment]
            if not self.in_place and self._in_order[segment] and self._next_index[segment] == len(units):
                digests.append(self._hashers[segment].intdigest())
            else:
                spans = segment_spans(self.layout, self.pool.num_pages, kind, layer, units, 0, self.pool.num_state_slots)
                digests.append(spans_digest(self.pool.data_view, spans, self.algorithm))
            nbytes += len(units) * self.layout.page_bytes(kind)
        return combine(digests, self.algorithm), nbytes

    def abort(self, reason: str) -> None:
        if self.done:
            return
        self.done = True
        dest = self.destination
        logger.warning("aborting shm KV write of request %s rank %d: %s", dest.request_id, self.rank, reason)
        record = CompletionRecord(
            SlotState.FAILED, dest.completion_sequence, int(self.algorithm), written_unix_ms=now_ms(),
            layout_hash=self.layout.hash, request_key=key_of(dest.request_id), lease_key=key_of(dest.binding),
        )
        try:
            self.pool.completions.finish(dest.completion_slot, dest.completion_sequence, dest.request_id, dest.binding, record)
        except UnknownTransfer:
            pass  # the decode side already dropped the request


class ShmWriter(KVWriter):
    """Prefill side: attaches decode pools by name (each once, layout-checked) and opens write handles."""

    transport = TransportKind.SHM

    def __init__(self, layout: KVLayout, algorithm: Algorithm = DEFAULT_ALGORITHM) -> None:
        self.layout = layout
        self.algorithm = Algorithm(algorithm)
        self._pools: dict[str, SharedPagePool] = {}
        self._lock = threading.Lock()

    def pool(self, name: str) -> SharedPagePool:
        with self._lock:
            if name not in self._pools:
                for gone in [old for old, pool in self._pools.items() if not pool.owner_alive()]:
                    self._pools.pop(gone).close()  # a dead decode worker's pool: unmapped, its memory freed
                self._pools[name] = self._attach(name)
            return self._pools[name]

    def _attach(self, name: str) -> SharedPagePool:
        return SharedPagePool.attach(name, self.layout)

    def confirm(self, destination: Destination) -> None:
        """Before the first byte: every target pool's completion slot must be reserved by the decode worker
        for this very lease (request, secret lease id, transport, pages); a forged or stale destination
        raises UnknownTransfer (or BadChunk) and nothing is written."""
        for rank in range(destination.num_ranks):
            pool = self._checked_pool(destination, rank)
            pool.completions.check_reserved(destination.completion_slot, destination.completion_sequence,
                                            destination.request_id, destination.binding)

    def _checked_pool(self, destination: Destination, rank: int) -> SharedPagePool:
        if destination.transport != self.transport:
            raise BadChunk(f"{type(self).__name__} cannot write a {destination.transport.name} destination")
        destination.check_against(self.layout, f"shm writer for request {destination.request_id}")
        destination.check_lease()
        pool = self.pool(destination.target(rank))
        if destination.pool_num_pages not in (0, pool.num_pages):
            raise BadChunk(f"destination expects {destination.pool_num_pages} pool pages, pool has {pool.num_pages}")
        if max(destination.page_ids) >= pool.num_pages:
            raise BadChunk(f"page {max(destination.page_ids)} outside pool {pool.name} of {pool.num_pages} pages")
        if not 0 <= destination.completion_slot < pool.header.num_slots:
            raise BadChunk(f"completion slot {destination.completion_slot} outside pool {pool.name}")
        if destination.state_slot is not None and destination.state_slot >= pool.num_state_slots:
            raise BadChunk(f"state slot {destination.state_slot} outside pool {pool.name} of {pool.num_state_slots}")
        return pool

    def open(self, destination: Destination, rank: int = 0, in_place: bool = False) -> ShmWriteHandle:
        pool = self._checked_pool(destination, rank)
        return ShmWriteHandle(pool, destination, rank, self.algorithm, in_place)

    def detach(self, name: str) -> None:
        with self._lock:
            pool = self._pools.pop(name, None)
        if pool is not None:
            pool.close()

    def close(self) -> None:
        for name in list(self._pools):
            self.detach(name)

