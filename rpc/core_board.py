"""Core lending on a CPU node: the decode worker borrows the prefill workers' cores while none of them computes.

`pdserve up` gives prefill and decode workers disjoint cores (pdserve/cpu_split.py), as separate GPUs would be:
a prefill forward never preempts a decode step's threads. But a prefill worker is idle most of the time (a
128-token prompt takes milliseconds, its answer dozens of decode steps), and its cores then sit unused while
decode, the part every token waits on, runs on half the machine. The board is a few bytes of shared memory
that let decode use those cores whenever prefill does not:

- byte `slot` (0..31): decode worker `slot` is inside a step that uses borrowed cores ("borrowing");
- byte 32 + slot: prefill worker `slot` is computing ("busy"), one byte per prefill worker;
- byte 64 + slot: decode worker `slot` has requests to step ("active");
- byte 96 + slot: prefill worker `slot` runs its steps on the decode workers' cores too ("prefill borrowing").

A prefill worker marks itself busy around each forward (`CoreBoard.prefilling`) and, before it computes,
waits until no decode worker is borrowing (at most the rest of one decode step, never more than
`LEND_BACK_WAIT_S`): its cores are its own again before its threads start. A decode worker looks at the
board before each step (`BorrowedCores.before_step`): every prefill worker idle -> it widens its threads'
CPU mask to its own cores plus the lent ones and runs that step with its extra threads (one decode worker:
a thread per lent core; several: the lent cores' share of each, which may be none: then the wider mask
alone lets the scheduler spread decode workers that share their own cores); any prefill busy -> its own
cores and thread count. The flag protocol is the classic two-flag handshake (each side raises its
flag, then reads the other's); a lost race costs one step of shared cores, never a wrong result: the board is
a performance hint, nothing reads it for correctness. No torch here: the caller hands over set_threads.

The other way round (`PrefillCores`): while no decode worker is active (nothing to decode: a long prompt's
prefill usually runs while decode idles), a prefill worker runs its steps on the decode workers' cores too. It
looks at the board before every engine step (its chunks are bounded, `pdserve up` sets 512 tokens), and a decode
worker that becomes active waits for the prefill step in flight to end before its own step (at most
`GIVE_BACK_WAIT_S`), so decode never shares its cores with a prefill forward for longer than one chunk."""
from __future__ import annotations

import contextlib
import mmap
import os
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

MAX_DECODE_SLOTS = 32
MAX_PREFILL_SLOTS = 32
_BUSY, _ACTIVE, _PREFILL_BORROWING = 32, 64, 96  # where each kind of byte starts (decode borrowing: at 0)
BOARD_BYTES = 128
LEND_BACK_WAIT_S = 0.25  # the longest a prefill forward waits for decode to give its cores back
GIVE_BACK_WAIT_S = 5.0  # the longest a decode step waits for a borrowing prefill step to end
STUCK_FLAG_IGNORE_S = 60.0  # after such a wait ran out (a prefill worker died mid-step), decode stops waiting this long
HANDOFF_HOLD_S = 2.0  # after a handoff, the longest a prefill worker waits for decode to start before borrowing
DEFAULT_BORROW_STEP_TOKENS = 512  # a borrowing prefill worker's engine steps take at most this many prompt tokens
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


def ensure_board(path: str) -> None:
    """Creates a zeroed board at `path` unless one is there: for workers started without `pdserve up` (the compose
    profile gives both workers one path on the /dev/shm they share). Published whole (written under a temporary
    name, then hard-linked), so a worker starting beside this one never maps a short file."""
    if os.path.exists(path):
        return
    directory = os.path.dirname(os.path.abspath(path))
    partial = create_board(directory)
    try:
        os.link(partial, path)
    except FileExistsError:  # the other worker was first: its board is the one
        pass
    finally:
        os.unlink(partial)


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
        self._map[_BUSY + _checked(slot, MAX_PREFILL_SLOTS)] = 1 if busy else 0

    def set_prefill_borrowing(self, slot: int, borrowing: bool) -> None:
        self._map[_PREFILL_BORROWING + _checked(slot, MAX_PREFILL_SLOTS)] = 1 if borrowing else 0

    def decode_active(self) -> bool:
        return self._map.find(b"\x01", _ACTIVE, _ACTIVE + MAX_DECODE_SLOTS) != -1

    # --- decode side -----------------------------------------------------------------------------------
    def prefill_busy(self) -> bool:
        return self._map.find(b"\x01", _BUSY, _BUSY + MAX_PREFILL_SLOTS) != -1

    def prefill_borrowing(self) -> bool:
        return self._map.find(b"\x01", _PREFILL_BORROWING, _PREFILL_BORROWING + MAX_PREFILL_SLOTS) != -1

    def set_active(self, slot: int, active: bool) -> None:
        self._map[_ACTIVE + _checked(slot, MAX_DECODE_SLOTS)] = 1 if active else 0

    def wait_prefill_returns(self) -> float:
        """Waits (at most GIVE_BACK_WAIT_S) until no prefill worker borrows decode's cores; returns the seconds."""
        started = time.monotonic()
        deadline = started + GIVE_BACK_WAIT_S
        while self.prefill_borrowing() and time.monotonic() < deadline:
            time.sleep(_POLL_S)
        return time.monotonic() - started

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


class _Cores:
    """A worker's two settings: its own cores and threads, or those plus the lent cores and extra_threads more
    (None: one per lent core). set_threads: torch.set_num_threads (called only on a change); pin: pin_threads
    (tests: fakes)."""

    def __init__(self, own: frozenset[int], lent: frozenset[int], own_threads: int,
                 set_threads: Callable[[int], None], pin: Callable[[frozenset[int]], None] = pin_threads,
                 extra_threads: int | None = None) -> None:
        self.own, self.wide = own, own | lent
        self.own_threads = own_threads
        self.wide_threads = own_threads + (len(self.wide - own) if extra_threads is None else extra_threads)
        self._set_threads, self._pin = set_threads, pin
        self.wide_now = False
        self.borrowed_steps = 0  # steps run on borrowed cores (metrics)
        self.steps = 0

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


class BorrowedCores(_Cores):
    """Decode worker `slot`'s side, called on its engine's step thread: before_step picks this step's cores and
    threads (and first waits for a prefill worker borrowing this worker's cores to end its step), after_step
    lowers the borrowing flag, idle says it has nothing left to step."""

    def __init__(self, board: CoreBoard, slot: int, own: frozenset[int], lent: frozenset[int], own_threads: int,
                 set_threads: Callable[[int], None], pin: Callable[[frozenset[int]], None] = pin_threads,
                 extra_threads: int | None = None) -> None:
        super().__init__(own, lent, own_threads, set_threads, pin, extra_threads)
        self.board, self.slot = board, _checked(slot, MAX_DECODE_SLOTS)
        self._clock = time.monotonic
        self.ignore_prefill_until = 0.0  # a wait for prefill ran out: do not wait again before then
        board.set_borrowing(slot, False)  # a predecessor may have died inside a borrowing step
        board.set_active(slot, False)

    def before_step(self) -> None:
        self.steps += 1
        self.board.set_active(self.slot, True)
        if self._clock() >= self.ignore_prefill_until and self.board.wait_prefill_returns() >= GIVE_BACK_WAIT_S:
            # the flag outlived any prefill step: its worker died inside one (its restart clears it)
            self.ignore_prefill_until = self._clock() + STUCK_FLAG_IGNORE_S
        self.board.set_borrowing(self.slot, True)
        if self.board.prefill_busy():  # a prefill computes or is about to: give its cores back first
            self.board.set_borrowing(self.slot, False)
            self._use(False)
            return
        self._use(True)
        self.borrowed_steps += 1

    def after_step(self) -> None:
        self.board.set_borrowing(self.slot, False)

    def idle(self) -> None:
        """Nothing left to step: prefill workers may borrow this worker's cores."""
        self.board.set_active(self.slot, False)


class PrefillCores(_Cores):
    """Prefill worker `slot`'s side, called on its engine thread: before_step (before each engine step of a
    prefill batch) runs the step on the decode workers' cores too while none of them is active, done (after the
    batch) hands them back. A batch that handed prompts off means decode work is on its way: until a decode
    worker is seen active (or HANDOFF_HOLD_S passed: the request may have been dropped), steps run on the
    prefill worker's own cores, so the new request's first decode step never waits for a borrowing step."""

    def __init__(self, board: CoreBoard, slot: int, own: frozenset[int], lent: frozenset[int], own_threads: int,
                 set_threads: Callable[[int], None], pin: Callable[[frozenset[int]], None] = pin_threads,
                 extra_threads: int | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(own, lent, own_threads, set_threads, pin, extra_threads)
        self.board, self.slot = board, _checked(slot, MAX_PREFILL_SLOTS)
        self._clock = clock
        self._hold_until = 0.0  # handed-off prompts on their way to decode: no borrowing until then
        board.set_prefill_borrowing(slot, False)  # a predecessor may have died inside a borrowing step

    def before_step(self) -> None:
        self.steps += 1
        self.board.set_prefill_borrowing(self.slot, True)
        if self.board.decode_active():  # decode has work: its cores are its own
            self._hold_until = 0.0
            self._narrow()
        elif self._clock() < self._hold_until:
            self._narrow()
        else:
            self._use(True)
            self.borrowed_steps += 1

    def done(self, handed_off: bool = False) -> None:
        self._narrow()
        if handed_off:
            self._hold_until = self._clock() + HANDOFF_HOLD_S

    def _narrow(self) -> None:
        self.board.set_prefill_borrowing(self.slot, False)
        self._use(False)
