"""The transport interface: KVWriter / KVWriteHandle on the prefill side, KVReceiver on the decode side.

Prefill (one writer per TP rank):
    handle = writer.open(destination, rank)        # layout and lease checked before any byte moves
    handle.write_pages(kind, layer, first_index, data)   # as prefill proceeds, layer by layer / chunk by chunk
    result = handle.finish()                        # completion record (shm) / end of stream (grpc)
or writer.push(local_cache, source_page_ids, destination, rank) to send pages prefill already computed.

Decode:
    destination = receiver.expect(lease, num_tokens)   # goes into the Prefill RPC
    result = receiver.admit(request_id, timeout_s)     # verified and complete, or raises (pages: on_failed)
    receiver.cancel(request_id)                        # abort / lease expiry: late writes are refused
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.cache.kv_cache import PagedLatentCache
from kvtransfer.destination import Destination
from kvtransfer.errors import BadChunk
from kvtransfer.layout import KVLayout, SegmentKind
from kvtransfer.leases import Lease
from kvtransfer.page_spans import page_runs


@dataclass(frozen=True)
class TransferResult:
    request_id: str
    bytes: int  # page bytes moved (all ranks for a receiver, one rank for a writer)
    checksum: int = 0  # request checksum (shm / mooncake), 0 where only per-chunk checksums exist
    ranks: int = 1


class KVWriteHandle(ABC):
    """One request's write session on one TP rank. Use as a context manager: an exception aborts it.
    host_only: page data must be CPU tensors (every transport but the device one)."""

    host_only = True

    def __init__(self, destination: Destination, rank: int, layout: KVLayout) -> None:
        self.destination = destination
        self.rank = rank
        self.layout = layout
        self.done = False

    def check_data(self, kind: SegmentKind, layer: int, first_index: int, data: torch.Tensor) -> None:
        """data: [n, page_size, row_dim] for destination pages first_index .. first_index + n - 1;
        kind STATE: the state slot's bytes, uint8 [1, state_bytes] (engine StatePool.raw rows)."""
        if not 0 <= layer < self.layout.num_segment_layers(kind):
            raise BadChunk(f"{kind.name.lower()} layer {layer} out of range")
        if kind == SegmentKind.STATE:
            expected, dtype = (self.layout.state_bytes,), torch.uint8
        else:
            expected, dtype = (self.layout.page_size, self.layout.row_dim(kind)), self.layout.torch_dtype
        if data.dim() != 1 + len(expected) or tuple(data.shape[1:]) != expected or data.dtype != dtype:
            raise BadChunk(f"{kind.name.lower()} data must be [n, {', '.join(map(str, expected))}] {dtype}, got "
                           f"{list(data.shape)} {data.dtype}")
        if self.host_only and data.device.type != "cpu":
            raise BadChunk("page data must be on the CPU (device pools: kvtransfer.device_transport)")
        count = len(self.destination.units(kind))
        if first_index < 0 or first_index + data.shape[0] > count:
            raise BadChunk(f"{kind.name.lower()} units {first_index}..{first_index + data.shape[0] - 1} outside the "
                           f"request's {count}")

    @abstractmethod
    def write_pages(self, kind: SegmentKind, layer: int, first_index: int, data: torch.Tensor) -> None:
        """Writes data [n, page_size, row_dim] into the destination's pages first_index .. first_index + n - 1."""

    def write_layer(self, layer: int, data: torch.Tensor, kind: SegmentKind = SegmentKind.TARGET) -> None:
        """Writes every page of one layer: data [len(page_ids), page_size, row_dim]."""
        self.write_pages(kind, layer, 0, data)

    @abstractmethod
    def finish(self) -> TransferResult:
        """Declares the request's pages written; raises if they are not all there."""

    @abstractmethod
    def abort(self, reason: str) -> None:
        """Gives up: the receiver fails the request (its pages go back to the pool). Idempotent."""

    def __enter__(self) -> KVWriteHandle:
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        if exc is not None and not self.done:
            self.abort(f"{type(exc).__name__}: {exc}")


class KVWriter(ABC):
    """Prefill side of one transport."""

    @abstractmethod
    def open(self, destination: Destination, rank: int = 0) -> KVWriteHandle:
        ...

    def push(
        self, cache: PagedLatentCache, source_page_ids: Sequence[int], destination: Destination, rank: int = 0,
        source_state_slot: int | None = None,
    ) -> TransferResult:
        """Copies a request's pages from a local cache (source_page_ids, in token order) into the destination,
        layer-major, one run of consecutive source pages at a time (views: no staging copy); with
        linear-attention state, then the cache's state slot source_state_slot."""
        if len(source_page_ids) != len(destination.page_ids):
            raise BadChunk(f"{len(source_page_ids)} source pages for {len(destination.page_ids)} destination pages")
        with self.open(destination, rank) as handle:
            for kind, layer in handle.layout.segments():
                if kind == SegmentKind.STATE:
                    if source_state_slot is None or cache.state is None:
                        raise BadChunk("this layout carries linear-attention state: push() needs source_state_slot")
                    handle.write_pages(kind, 0, 0, cache.state.raw[source_state_slot : source_state_slot + 1])
                    continue
                pages = cache.layer(layer) if kind == SegmentKind.TARGET else cache.draft_layer(layer)
                for index, first, count in page_runs(source_page_ids):
                    handle.write_pages(kind, layer, index, pages[first : first + count])
            return handle.finish()

    def close(self) -> None:
        """Releases connections / mappings."""


class KVReceiver(ABC):
    """Decode side of one transport: owns nothing but the bookkeeping; the decode worker owns the pages."""

    @abstractmethod
    def expect(self, lease: Lease, num_tokens: int) -> Destination:
        """Registers a reserved request and returns where prefill must write it."""

    def narrow(self, request_id: str, num_tokens: int) -> Destination:
        """A standing lease claimed by a prompt of num_tokens (<= the lease's) tokens: from now on the
        request's KV is its first ceil(num_tokens / page_size) pages (Destination.narrowed), still bound to
        the whole lease. Transports that cannot do this raise NotImplementedError."""
        raise NotImplementedError(f"{type(self).__name__} does not serve standing leases")

    @abstractmethod
    def admit(self, request_id: str, timeout_s: float = 0.0) -> TransferResult:
        """Waits up to timeout_s for the request's KV; returns once complete and verified.

        Raises TransferTimeout (still pending: call again or cancel) or another KVTransferError (the
        request failed: on_failed(request_id) has been called and the request is forgotten).
        """

    def admit_now(self, request_id: str, max_verify_bytes: int) -> TransferResult | None:
        """admit() at once, when that is known to be cheap: the KV is complete already and admitting it
        reads at most max_verify_bytes (checksums) and copies nothing. None: call admit() off the event
        loop. Raises what admit() raises."""
        return None

    @abstractmethod
    def cancel(self, request_id: str) -> None:
        """Forgets a request (abort, lease expiry); later writes for it are refused. Idempotent."""
