"""Destination: where prefill writes one request's KV (the domain side of the KVDestination message)."""
from __future__ import annotations

import enum
import functools
import time
from dataclasses import dataclass, replace

from kvtransfer.errors import BadChunk, LeaseExpired
from kvtransfer.layout import KVLayout, SegmentKind, check_layout
from kvtransfer.page_spans import unit_ids


class TransportKind(enum.IntEnum):
    """Values match the Transport enum of protos/pdserve/internal/v1/kv.proto."""

    SHM = 1
    GRPC = 2
    MOONCAKE = 3
    DEVICE = 4


def now_ms() -> int:
    return int(time.time() * 1000)


def lease_binding(lease_id: str, transport: TransportKind | int, page_ids: tuple[int, ...] | list[int],
                  num_tokens: int, state_slot: int | None = None, cached_tokens: int = 0) -> str:
    """What a completion slot's lease key fingerprints: the secret lease id together with the transport,
    the pages, the token count and the state slot, so a destination naming other pages (or another slot,
    or transport) under a real lease id matches no slot, and prefill refuses it before writing."""
    binding = f"{lease_id}/{int(transport)}/{num_tokens}/{','.join(map(str, page_ids))}"
    if cached_tokens:
        binding += f"/cached={cached_tokens}"
    return binding if state_slot is None else f"{binding}/state={state_slot}"


@dataclass(frozen=True)
class Destination:
    """A request's reserved decode pages and, per TP rank, where to write them.

    targets[r]: shm pool name (SHM), "host:port" (GRPC), mooncake session id (MOONCAKE) or device pool name
    (DEVICE: the pool's control segment, kvtransfer.device_pool) of decode rank r.
    """

    transport: TransportKind
    layout_hash: str
    request_id: str
    lease_id: str
    page_ids: tuple[int, ...]
    targets: tuple[str, ...]
    lease_deadline_unix_ms: int
    num_tokens: int
    pool_num_pages: int = 0
    completion_slot: int = -1
    completion_sequence: int = 0
    data_addresses: tuple[int, ...] = ()
    record_addresses: tuple[int, ...] = ()
    state_slot: int | None = None  # models with linear attention: the decode state slot reserved with the pages
    # A standing lease used by a shorter prompt: every page it holds (page_ids is a prefix) and the token count
    # it was granted for; the completion slot is bound to these. Empty / 0: the lease is page_ids, num_tokens.
    lease_page_ids: tuple[int, ...] = ()
    lease_num_tokens: int = 0
    # The decode worker's prefix-cache hit: it holds tokens [0, cached_tokens) (whole pages) already, so page_ids
    # are the pages of tokens [cached_tokens, num_tokens) only - what prefill writes and the record covers.
    # checkpoint_tokens (linear attention): where it holds a KDA state checkpoint (<= cached_tokens; 0: none).
    cached_tokens: int = 0
    checkpoint_tokens: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "transport", TransportKind(self.transport))
        for name in ("page_ids", "targets", "data_addresses", "record_addresses", "lease_page_ids"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if not self.request_id or not self.lease_id:
            raise ValueError("Destination needs a request id and a lease id")
        if not self.page_ids or not self.targets:
            raise ValueError("Destination needs at least one page and one target")
        if len(set(self.page_ids)) != len(self.page_ids) or min(self.page_ids) < 0:
            raise ValueError("Destination page ids must be distinct and non-negative")
        if self.pool_num_pages and max(self.page_ids) >= self.pool_num_pages:
            raise ValueError(f"page id {max(self.page_ids)} outside a pool of {self.pool_num_pages} pages")
        if self.num_tokens <= 0:
            raise ValueError("Destination.num_tokens must be positive")
        if not 0 <= self.checkpoint_tokens <= self.cached_tokens < self.num_tokens:
            raise ValueError(f"Destination: cached_tokens {self.cached_tokens} and checkpoint_tokens "
                             f"{self.checkpoint_tokens} must satisfy 0 <= checkpoint <= cached < num_tokens")
        if self.cached_tokens and self.lease_page_ids:
            raise ValueError("a standing lease holds no cached pages")
        if self.state_slot is not None and self.state_slot < 0:
            raise ValueError(f"Destination.state_slot must be non-negative, got {self.state_slot}")
        if self.transport == TransportKind.MOONCAKE and not (
            len(self.data_addresses) == len(self.record_addresses) == len(self.targets)
        ):
            raise ValueError("a mooncake Destination needs a data and a record address per target")
        if bool(self.lease_page_ids) != bool(self.lease_num_tokens):
            raise ValueError("Destination.lease_page_ids and lease_num_tokens go together")
        if self.lease_page_ids and (self.lease_page_ids[:len(self.page_ids)] != self.page_ids
                                    or self.num_tokens > self.lease_num_tokens):
            raise ValueError("a Destination's pages and tokens must be a prefix of its lease's")

    @functools.cached_property
    def binding(self) -> str:
        """What the completion slot is bound to: the lease as granted (a standing lease: all its pages).
        Built once per destination: prefill checks it before, during and after its forward."""
        return lease_binding(self.lease_id, self.transport, self.lease_page_ids or self.page_ids,
                             self.lease_num_tokens or self.num_tokens, self.state_slot, self.cached_tokens)

    def narrowed(self, num_tokens: int, page_size: int) -> Destination:
        """This destination for a prompt of num_tokens <= num_tokens tokens: the first ceil(num_tokens /
        page_size) pages, still bound to the whole lease (a standing lease claimed by a shorter prompt)."""
        if not 0 < num_tokens <= self.num_tokens:
            raise ValueError(f"cannot narrow a destination of {self.num_tokens} tokens to {num_tokens}")
        pages = -(-num_tokens // page_size)
        return replace(self, page_ids=self.page_ids[:pages], num_tokens=num_tokens,
                       lease_page_ids=self.lease_page_ids or self.page_ids,
                       lease_num_tokens=self.lease_num_tokens or self.num_tokens)

    @property
    def num_ranks(self) -> int:
        return len(self.targets)

    def target(self, rank: int) -> str:
        if not 0 <= rank < len(self.targets):
            raise ValueError(f"rank {rank} has no target (destination has {len(self.targets)})")
        return self.targets[rank]

    def check_lease(self, at_ms: int | None = None) -> None:
        """Raises LeaseExpired once the lease deadline has passed: writers must not touch the pages then."""
        if (now_ms() if at_ms is None else at_ms) >= self.lease_deadline_unix_ms:
            raise LeaseExpired(f"lease {self.lease_id} of request {self.request_id} expired")

    def check_against(self, layout: KVLayout, where: str) -> None:
        """Layout hash and page count (ceil(num_tokens / page_size) pages) must fit the local layout, and a
        layout with linear-attention state needs a state slot (one without state, none)."""
        check_layout(layout, self.layout_hash, where)
        if self.cached_tokens % layout.page_size:
            raise BadChunk(f"{where}: cached_tokens {self.cached_tokens} is not a whole number of pages of "
                           f"{layout.page_size}")
        need = layout.pages_for_tokens(self.num_tokens) - self.cached_tokens // layout.page_size
        if need != len(self.page_ids):
            raise BadChunk(f"{self.num_tokens} tokens ({self.cached_tokens} cached) need {need} pages of "
                           f"{layout.page_size}, got {len(self.page_ids)}")
        if layout.has_state != (self.state_slot is not None):
            raise BadChunk(f"{where}: the layout {'has' if layout.has_state else 'has no'} linear-attention state "
                           f"but the destination {'names no' if self.state_slot is None else 'names a'} state slot")

    def units(self, kind: SegmentKind) -> tuple[int, ...]:
        """The destination "pages" of a segment kind: page ids, or (STATE) the one state slot."""
        return unit_ids(kind, self.page_ids, self.state_slot)

    # --- protobuf ---------------------------------------------------------------------------------------
    def to_proto(self):
        from rpc.internal.v1 import kv_pb2

        return kv_pb2.KVDestination(
            transport=int(self.transport), layout_hash=self.layout_hash, page_ids=self.page_ids,
            targets=self.targets, request_id=self.request_id, lease_id=self.lease_id,
            lease_deadline_unix_ms=self.lease_deadline_unix_ms, num_tokens=self.num_tokens,
            pool_num_pages=self.pool_num_pages, completion_slot=self.completion_slot,
            completion_sequence=self.completion_sequence, data_addresses=self.data_addresses,
            record_addresses=self.record_addresses, state_slot=self.state_slot,
            lease_page_ids=self.lease_page_ids, lease_num_tokens=self.lease_num_tokens,
            cached_tokens=self.cached_tokens, checkpoint_tokens=self.checkpoint_tokens,
        )

    @classmethod
    def from_proto(cls, message) -> Destination:
        if message.transport not in TransportKind._value2member_map_:
            raise ValueError(f"KVDestination.transport {message.transport} is not a known transport")
        return cls(
            transport=TransportKind(message.transport), layout_hash=message.layout_hash,
            request_id=message.request_id, lease_id=message.lease_id, page_ids=tuple(message.page_ids),
            targets=tuple(message.targets), lease_deadline_unix_ms=message.lease_deadline_unix_ms,
            num_tokens=message.num_tokens, pool_num_pages=message.pool_num_pages,
            completion_slot=message.completion_slot, completion_sequence=message.completion_sequence,
            data_addresses=tuple(message.data_addresses), record_addresses=tuple(message.record_addresses),
            state_slot=message.state_slot if message.HasField("state_slot") else None,
            lease_page_ids=tuple(message.lease_page_ids), lease_num_tokens=message.lease_num_tokens,
            cached_tokens=message.cached_tokens, checkpoint_tokens=message.checkpoint_tokens,
        )
