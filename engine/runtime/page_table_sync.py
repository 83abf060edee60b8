"""Tensor-parallel step plans carry page-table deltas, not whole page tables.

Every follower rank needs each step's page tables, but a running sequence's page list changes by a page
every page_size tokens: sending the whole lists every step (64 sequences x 10,240 pages at 163,840 positions
and 16-token pages: 655k ints pickled, broadcast and unpickled per step) is host time spent on nothing.
The leader's PageTableSender keeps a copy of what the followers hold for each sequence (keyed by the plan's
seq_keys) and encodes a plan's tables as a TableDelta: the handle of each row, the edits (keep the first
`keep` pages, then append `tail`), the handles the followers may forget, a message number and a checksum.
Each follower's PageTableReceiver applies the edits to its mirror and rebuilds the plan's lists.

Invariants:
- Exact: the sender compares each new list with its copy of the follower's (C-level list comparison, no
  assumption about how the engine edits page lists); an edit is emitted only for what differs, and a list that
  is not an extension or a truncation of the old one is sent whole.
- Checked: every message carries its number (epoch) and a checksum of the rebuilt tables (a rolling hash per
  sequence, kept incrementally on both sides: O(rows + edited pages) per step). A receiver that sees a gap in
  the numbers, an unknown handle or a checksum that does not match raises PageTableDesync and runs nothing:
  a wrong table is never used silently.
- Resync: a message with reset set makes the receiver drop its mirror first and carries every row whole.
  The sender sends one first, after invalidate() (a broadcast that failed may or may not have arrived), and
  after resync() (forced: a test, an operator)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Hashable, Sequence

_MOD = (1 << 61) - 1  # a Mersenne prime: the rolling hashes stay below it
_BASE = 1_000_003


class PageTableDesync(RuntimeError):
    """A follower's page-table mirror does not match the leader's (a lost, repeated or corrupted delta)."""


@dataclass(frozen=True)
class TableDelta:
    """One plan's page tables as edits to the follower's mirror.

    epoch: the message number (the receiver expects its previous + 1, or a reset).
    reset: drop the mirror before applying (every row's handle then has a whole-list edit).
    handles: row i of the plan is the mirror's list for handles[i].
    edits: (handle, keep, tail): the list for handle becomes its first `keep` pages + tail.
    drops: handles forgotten after the rows are rebuilt.
    checksum: of the rebuilt rows (row_fingerprint, combined by row_checksum)."""

    epoch: int
    reset: bool
    handles: tuple[int, ...]
    edits: tuple[tuple[int, int, tuple[int, ...]], ...]
    drops: tuple[int, ...]
    checksum: int


def _extend_hashes(hashes: list[int], pages: Sequence[int]) -> None:
    value = hashes[-1] if hashes else 0
    for page in pages:
        value = (value * _BASE + page + 1) % _MOD
        hashes.append(value)


def _row_checksum(fingerprints: list[tuple[int, int]]) -> int:
    """Combines (length, hash) per row, in row order."""
    total = 0
    for length, value in fingerprints:
        total = (total * _BASE + value * 65_537 + length + 1) % _MOD
    return total


class _Mirror:
    """Page lists by handle, each with its rolling prefix hashes (hashes[i] covers pages[: i + 1])."""

    def __init__(self) -> None:
        self.pages: dict[int, list[int]] = {}
        self.hashes: dict[int, list[int]] = {}

    def apply(self, handle: int, keep: int, tail: Sequence[int]) -> None:
        pages = self.pages.setdefault(handle, [])
        hashes = self.hashes.setdefault(handle, [])
        if keep > len(pages):
            raise PageTableDesync(f"an edit keeps {keep} pages of handle {handle}, which holds {len(pages)}")
        del pages[keep:]
        del hashes[keep:]
        pages.extend(tail)
        _extend_hashes(hashes, tail)

    def fingerprint(self, handle: int) -> tuple[int, int]:
        hashes = self.hashes[handle]
        return len(hashes), hashes[-1] if hashes else 0

    def drop(self, handle: int) -> None:
        self.pages.pop(handle, None)
        self.hashes.pop(handle, None)

    def clear(self) -> None:
        self.pages.clear()
        self.hashes.clear()


class PageTableSender:
    """The leader's side: encode(keys, page_tables) -> TableDelta, keeping a copy of every follower's mirror.
    max_idle: a handle no plan named for that many messages is dropped on both sides (sequences that ended)."""

    def __init__(self, max_idle: int = 256) -> None:
        if max_idle < 1:
            raise ValueError(f"max_idle must be >= 1, got {max_idle}")
        self.max_idle = max_idle
        self._mirror = _Mirror()
        self._handles: dict[Hashable, int] = {}
        self._keys: dict[int, Hashable] = {}
        self._last_used: dict[int, int] = {}
        self._next_handle = 0
        self.epoch = 0
        self._reset = True  # the first message tells the receivers to start from nothing
        self.pages_sent = 0  # running totals, for tests and metrics: page entries sent, rows sent whole,
        self.rows_sent_whole = 0
        self.pages_in_plans = 0  # and page entries the plans held

    def invalidate(self) -> None:
        """The last message may not have reached every follower: the next one resets and sends every row whole."""
        self._reset = True

    resync = invalidate

    def encode(self, keys: Sequence[Hashable], page_tables: Sequence[Sequence[int]]) -> TableDelta:
        if len(keys) != len(page_tables):
            raise ValueError(f"{len(keys)} keys for {len(page_tables)} page tables")
        reset, self._reset = self._reset, False
        if reset:
            self._mirror.clear()
            self._handles.clear()
            self._keys.clear()
            self._last_used.clear()
        self.epoch += 1
        mirror = self._mirror
        handles: list[int] = []
        edits: list[tuple[int, int, tuple[int, ...]]] = []
        fingerprints: list[tuple[int, int]] = []
        for key, pages in zip(keys, page_tables):
            handle = self._handles.get(key)
            if handle is None:
                handle = self._next_handle
                self._next_handle += 1
                self._handles[key], self._keys[handle] = handle, key
            edit = _edit(mirror.pages.get(handle), pages if isinstance(pages, list) else list(pages))
            if edit is not None:
                keep, tail = edit
                mirror.apply(handle, keep, tail)
                edits.append((handle, keep, tuple(tail)))
                self.pages_sent += len(tail)
                self.rows_sent_whole += keep == 0 and bool(tail)
            handles.append(handle)
            self.pages_in_plans += len(pages)
            self._last_used[handle] = self.epoch
            fingerprints.append(mirror.fingerprint(handle))
        drops = self._idle_handles() if self.epoch % 64 == 0 else []
        for handle in drops:
            mirror.drop(handle)
            self._handles.pop(self._keys.pop(handle), None)
            self._last_used.pop(handle, None)
        return TableDelta(self.epoch, reset, tuple(handles), tuple(edits), tuple(drops), _row_checksum(fingerprints))

    def _idle_handles(self) -> list[int]:
        horizon = self.epoch - self.max_idle
        return sorted(handle for handle, used in self._last_used.items() if used <= horizon)

    @property
    def mirrored(self) -> int:
        """How many sequences' page lists the followers hold."""
        return len(self._mirror.pages)


def _edit(old: list[int] | None, new: list[int]) -> tuple[int, list[int]] | None:
    """(keep, tail) turning old into new, or None when they are equal. Exact: prefixes are compared whole."""
    if old is None:
        return 0, new
    m, n = len(old), len(new)
    if m <= n and new[:m] == old:
        return None if m == n else (m, new[m:])
    if n < m and old[:n] == new:
        return n, []
    return 0, new


class PageTableReceiver:
    """A follower's side: decode(delta) -> the plan's page tables (lists owned by the mirror: read only)."""

    def __init__(self) -> None:
        self._mirror = _Mirror()
        self.epoch: int | None = None  # None: nothing received yet (the first message must reset)

    def decode(self, delta: TableDelta) -> list[list[int]]:
        if delta.reset:
            self._mirror.clear()
        elif self.epoch is None or delta.epoch != self.epoch + 1:
            self.epoch = None  # refuse every later delta too, until a reset
            raise PageTableDesync(f"page-table delta {delta.epoch} after {self.epoch}: a message was lost or repeated")
        mirror = self._mirror
        try:
            for handle, keep, tail in delta.edits:
                mirror.apply(handle, keep, tail)
            tables = [mirror.pages[handle] for handle in delta.handles]
            checksum = _row_checksum([mirror.fingerprint(handle) for handle in delta.handles])
        except KeyError as error:
            self.epoch = None
            raise PageTableDesync(f"page-table delta {delta.epoch} names handle {error.args[0]}, which this rank "
                                  "does not hold") from None
        except PageTableDesync:
            self.epoch = None
            raise
        if checksum != delta.checksum:
            self.epoch = None
            raise PageTableDesync(f"page-table delta {delta.epoch}: this rank's tables do not match the leader's "
                                  "(checksum)")
        for handle in delta.drops:
            mirror.drop(handle)
        self.epoch = delta.epoch
        return tables


@dataclass(frozen=True)
class DeltaPlan:
    """What the leader broadcasts for a plan with page tables: the plan without them, and their delta."""

    plan: object  # TargetPlan | DraftPlan with page_tables = [] and seq_keys = None (the followers need neither)
    delta: TableDelta


def to_wire(sender: PageTableSender, plan):
    """plan as it travels to the followers: a DeltaPlan when it has page tables and sequence keys, else itself."""
    keys = getattr(plan, "seq_keys", None)
    if keys is None:
        return plan
    delta = sender.encode(keys, plan.page_tables)
    return DeltaPlan(dataclasses.replace(plan, page_tables=[], seq_keys=None), delta)


def from_wire(receiver: PageTableReceiver, wire):
    """The plan a follower runs (raises PageTableDesync instead of rebuilding a wrong one)."""
    if not isinstance(wire, DeltaPlan):
        return wire
    return dataclasses.replace(wire.plan, page_tables=receiver.decode(wire.delta))
