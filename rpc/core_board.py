"""Core lending on a CPU node: the decode worker borrows the prefill workers' cores while none of them computes.

`pdserve up` gives prefill and decode workers disjoint cores (pdserve/cpu_split.py), as separate GPUs would be:
a prefill forward never preempts a decode step's threads. But a prefill worker is idle most of the time (a
128-token prompt takes milliseconds, its answer dozens of decode steps), and its cores then sit unused while
decode, the part every token waits on, runs on half the machine. The board is a few bytes of shared memory
that let decode use those cores whenever prefill does not:

- byte `slot` (0..31): decode worker `slot` is inside a step that uses borrowed cores ("borrowing");
- byte 32 + slot: prefill worker `slot` is computing ("busy"), one byte per prefill worker.

A prefill worker marks itself busy around each forward (`CoreBoard.prefilling`) and, before it computes,
waits until no decode worker is borrowing (at most the rest of one decode step, never more than
`LEND_BACK_WAIT_S`): its cores are its own again before its threads start. A decode worker looks at the
board before each step (`BorrowedCores.before_step`): every prefill worker idle -> it widens its threads'
CPU mask to its own cores plus the lent ones and runs that step with its extra threads (one decode worker:
a thread per lent core; several: the lent cores' share of each, which may be none: then the wider mask
alone lets the scheduler spread decode workers that share their own cores); any prefill busy -> its own
cores and thread count. The flag protocol is the classic two-flag handshake (each side raises its
flag, then reads the other's); a lost race costs one step of shared cores, never a wrong result: the board is
a performance hint, nothing reads it for correctness. No torch here: the caller hands over set_threads."""
from __future__ import annotations

import contextlib
import mmap
import os
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

BOARD_BYTES = 64
MAX_DECODE_SLOTS = 32
MAX_PREFILL_SLOTS = BOARD_BYTES - MAX_DECODE_SLOTS
LEND_BACK_WAIT_S = 0.25  # the longest a prefill forward waits for decode to give its cores back
_POLL_S = 0.0005
_NOT_BORROWING = bytes(MAX_DECODE_SLOTS)


def create_board(directory: str) -> str:
    """A new, zeroed board file in `directory` (the launcher's run directory, removed when the cluster stops;
    the file is only ever used through shared mappings); returns its path."""
    path = os.path.join(directory, f"pdserve-cores-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.write(fd, bytes(BOARD_BYTES))
    finally:
        os.close(fd)
    return path


class CoreBoard:
    """One process's view of a board file (mapped shared; `close` unmaps it)."""

    def __init__(self, path: str) -> None:
        with open(path, "r+b") as handle:
            if os.fstat(handle.fileno()).st_size < BOARD_BYTES:
                raise ValueError(f"core board {path} is not a board (shorter than {BOARD_BYTES} bytes)")
            self._map = mmap.mmap(handle.fileno(), BOARD_BYTES)
        self.path = path

    def close(self) -> None:
        self._map.close()

    # --- prefill side ----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def prefilling(self, slot: int) -> Iterator[float]:
        """Marks prefill worker `slot` busy for the block; yields how long it waited for decode to hand its
        borrowed cores back (seconds)."""
        self.set_busy(slot, True)
        started = time.monotonic()
        deadline = started + LEND_BACK_WAIT_S
        while self._map[:MAX_DECODE_SLOTS] != _NOT_BORROWING and time.monotonic() < deadline:
            time.sleep(_POLL_S)
        try:
            yield time.monotonic() - started
        finally:
            self.set_busy(slot, False)

    def set_busy(self, slot: int, busy: bool) -> None:
        """(A restarted prefill worker clears its slot: its predecessor may have died inside a forward.)"""
        self._map[MAX_DECODE_SLOTS + _checked(slot, MAX_PREFILL_SLOTS)] = 1 if busy else 0

    # --- decode side -----------------------------------------------------------------------------------
    def prefill_busy(self) -> bool:
        return self._map.find(b"\x01", MAX_DECODE_SLOTS) != -1

    def set_borrowing(self, slot: int, borrowing: bool) -> None:
        self._map[_checked(slot, MAX_DECODE_SLOTS)] = 1 if borrowing else 0

    def borrowing(self, slot: int) -> bool:
        return bool(self._map[_checked(slot, MAX_DECODE_SLOTS)])


def _checked(slot: int, slots: int) -> int:
    if not 0 <= slot < slots:
        raise ValueError(f"core board slot {slot} is outside 0..{slots - 1}")
    return slot


def pin_threads(cpus: frozenset[int]) -> None:
    """Every thread of this process (the OpenMP team included) on `cpus` (threads started later inherit it)."""
    for task in Path("/proc/self/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cpus)
        except (ProcessLookupError, PermissionError):  # a thread that ended meanwhile
            continue


class BorrowedCores:
    """Decode worker `slot`'s side, called on its engine's step thread: before_step picks this step's cores and
    threads, after_step lowers the borrowing flag. extra_threads: threads added while borrowing (None: one per
    lent core). set_threads: torch.set_num_threads (called only on a change); pin: pin_threads (tests: fakes)."""

    def __init__(self, board: CoreBoard, slot: int, own: frozenset[int], lent: frozenset[int], own_threads: int,
                 set_threads: Callable[[int], None], pin: Callable[[frozenset[int]], None] = pin_threads,
                 extra_threads: int | None = None) -> None:
        self.board, self.slot = board, _checked(slot, MAX_DECODE_SLOTS)
        self.own, self.wide = own, own | lent
        self.own_threads = own_threads
        self.wide_threads = own_threads + (len(self.wide - own) if extra_threads is None else extra_threads)
        self._set_threads, self._pin = set_threads, pin
        self.wide_now = False
        self.borrowed_steps = 0  # steps run on borrowed cores (metrics)
        self.steps = 0
        board.set_borrowing(slot, False)  # a predecessor may have died inside a borrowing step

    def before_step(self) -> None:
        self.steps += 1
        self.board.set_borrowing(self.slot, True)
        if self.board.prefill_busy():  # a prefill computes or is about to: give its cores back first
            self.board.set_borrowing(self.slot, False)
            self._use(False)
            return
        self._use(True)
        self.borrowed_steps += 1

    def after_step(self) -> None:
        self.board.set_borrowing(self.slot, False)

    def _use(self, wide: bool) -> None:
        if wide == self.wide_now:
            return
        if wide:  # the mask first: the extra OpenMP threads start (or wake) on the lent cores
            self._pin(self.wide)
            if self.wide_threads != self.own_threads:
                self._set_threads(self.wide_threads)
        else:
            if self.wide_threads != self.own_threads:
                self._set_threads(self.own_threads)
            self._pin(self.own)
        self.wide_now = wide
