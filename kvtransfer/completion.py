"""Per-request completion records in a fixed slot table inside the shm pool (one slot per in-flight lease).

Slot life: the reader (decode) reserves a slot for a lease (state RESERVED, sequence s, the request and
lease keys); the writer (prefill), after writing every page, writes state COMPLETE with sequence s + 1,
the bytes it wrote, the checksum over the pages, the token count and the layout hash (or FAILED when it
gives up); the reader verifies the record and the pages, then releases the slot (state EMPTY, sequence
kept so a stale record from an older lease can never match a newer one).

Each 128-byte slot ends in a crc32 of its fields: a torn read (writer mid-update) fails that check and
is retried, so no cross-process lock is needed.
"""
from __future__ import annotations

import enum
import functools
import hashlib
import struct
import time
import zlib
from dataclasses import dataclass

from kvtransfer.errors import UnknownTransfer

SLOT_BYTES = 128
_FIELDS = struct.Struct("<IIQQQQQ16s16s16s")
_CHECK = struct.Struct("<Q")


class SlotState(enum.IntEnum):
    EMPTY = 0
    RESERVED = 1
    COMPLETE = 2
    FAILED = 3


@functools.lru_cache(maxsize=1024)
def key_of(text: str) -> bytes:
    """16-byte fingerprint of a request or lease id (fixed size for the slot). Cached: a request's ids are
    fingerprinted at every check of its slot (reserve, prefill's confirmations, the record, admission)."""
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest()


@dataclass(frozen=True)
class CompletionRecord:
    state: SlotState
    sequence: int
    algorithm: int = 0
    bytes_written: int = 0
    checksum: int = 0
    num_tokens: int = 0
    written_unix_ms: int = 0
    layout_hash: str = ""
    request_key: bytes = b"\0" * 16
    lease_key: bytes = b"\0" * 16

    def pack(self) -> bytes:
        fields = _FIELDS.pack(
            int(self.state), self.algorithm, self.sequence, self.bytes_written, self.checksum, self.num_tokens,
            self.written_unix_ms, self.layout_hash.encode("ascii"), self.request_key, self.lease_key,
        )
        return fields + _CHECK.pack(zlib.crc32(fields))

    @classmethod
    def unpack(cls, raw: bytes) -> CompletionRecord | None:
        """None when the slot is blank or torn (its crc does not match)."""
        fields = raw[: _FIELDS.size]
        (check,) = _CHECK.unpack_from(raw, _FIELDS.size)
        if check != zlib.crc32(fields) or not any(raw):
            return None
        state, algorithm, sequence, nbytes, checksum, tokens, written, layout, request, lease = _FIELDS.unpack(fields)
        if state not in SlotState._value2member_map_:
            return None
        return cls(
            SlotState(state), sequence, algorithm, nbytes, checksum, tokens, written,
            layout.rstrip(b"\0").decode("ascii"), request, lease,
        )

    def belongs_to(self, request_id: str, lease: str) -> bool:
        """lease: the lease's binding (Destination.binding: lease id, transport, pages, tokens)."""
        return self.request_key == key_of(request_id) and self.lease_key == key_of(lease)


_MAX_SEQUENCE = 2**64 - 1  # (the slot's sequence field: u64)


@functools.lru_cache(maxsize=1024)
def reserved_slot(sequence: int, request_id: str, lease: str) -> bytes:
    """The slot's exact bytes (crc included) once reserve() has reserved it for this lease at `sequence`.
    Cached: prefill checks the same reservation before, during and after its forward."""
    return CompletionRecord(SlotState.RESERVED, sequence, request_key=key_of(request_id), lease_key=key_of(lease)).pack()


class CompletionTable:
    """The slot table of one pool: num_slots records of SLOT_BYTES each, over a shared byte view."""

    def __init__(self, view: memoryview, num_slots: int) -> None:
        if len(view) < num_slots * SLOT_BYTES:
            raise ValueError("completion area too small")
        self._view = view
        self.num_slots = num_slots

    def _range(self, slot: int) -> slice:
        if not 0 <= slot < self.num_slots:
            raise UnknownTransfer(f"completion slot {slot} out of range (pool has {self.num_slots})")
        return slice(slot * SLOT_BYTES, slot * SLOT_BYTES + _FIELDS.size + _CHECK.size)

    def read(self, slot: int, retries: int = 100) -> CompletionRecord | None:
        """The slot's record; None if it was never written. Retries torn reads briefly."""
        span = self._range(slot)
        for _ in range(retries):
            raw = bytes(self._view[span])
            record = CompletionRecord.unpack(raw)
            if record is not None or not any(raw):
                return record
            time.sleep(0.0001)
        raise UnknownTransfer(f"completion slot {slot} keeps reading torn")

    def write(self, slot: int, record: CompletionRecord) -> None:
        self._view[self._range(slot)] = record.pack()

    # --- reader side -------------------------------------------------------------------------------
    def sequence(self, slot: int) -> int:
        current = self.read(slot)
        return current.sequence if current is not None else 0

    def reserve(self, slot: int, request_id: str, lease_id: str, at_least: int = 0) -> int:
        """Marks the slot RESERVED for a lease; returns the sequence number the writer's record must carry
        (one more than the slot's, or than at_least when larger: TP ranks' pools reserve in lockstep)."""
        base = max(self.sequence(slot), at_least)
        self._view[self._range(slot)] = reserved_slot(base, request_id, lease_id)
        return base + 1

    def release(self, slot: int) -> None:
        """Empties the slot (keeping its sequence number, so older records never match a later lease)."""
        current = self.read(slot)
        self.write(slot, CompletionRecord(SlotState.EMPTY, current.sequence if current is not None else 0))

    # --- writer side -------------------------------------------------------------------------------
    def check_reserved(self, slot: int, sequence: int, request_id: str, lease: str) -> None:
        """Raises UnknownTransfer unless the decode side reserved the slot for exactly this lease (request,
        lease id, transport, pages: see Destination.binding) and has not released it since."""
        if 0 < sequence <= _MAX_SEQUENCE and bytes(self._view[self._range(slot)]) == reserved_slot(
                sequence - 1, request_id, lease):
            return  # byte for byte what reserve() wrote for this lease: no need to parse the record
        current = self.read(slot)
        if (
            current is None
            or current.state != SlotState.RESERVED
            or current.sequence != sequence - 1
            or not current.belongs_to(request_id, lease)
        ):
            raise UnknownTransfer(
                f"completion slot {slot} is not reserved for this lease of request {request_id} "
                "(forged, cancelled or expired)"
            )

    def finish(self, slot: int, sequence: int, request_id: str, lease: str, record: CompletionRecord) -> None:
        """Writes a COMPLETE / FAILED record, after checking the slot is still reserved for this lease."""
        self.check_reserved(slot, sequence, request_id, lease)
        self.write(slot, record)
