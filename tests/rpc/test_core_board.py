"""Core lending (rpc/core_board.py): the decode side widens its cores and threads only while every prefill
worker on the board is idle, narrows them before a step when one is busy, and a prefill forward waits for a
borrowing decode step to end (never past the cap); boards and slots that are wrong are named."""
from __future__ import annotations

import threading
import time

import pytest

from rpc import core_board
from rpc.core_board import MAX_DECODE_SLOTS, MAX_PREFILL_SLOTS, BorrowedCores, CoreBoard, PrefillCores, create_board

OWN, LENT = frozenset({1}), frozenset({0})


@pytest.fixture
def board(tmp_path):
    view = CoreBoard(create_board(str(tmp_path)))
    yield view
    view.close()


class _Recorder:
    """Stands for torch.set_num_threads and pin_threads: what each was called with, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    def threads(self, count: int) -> None:
        self.calls.append(("threads", count))

    def pin(self, cpus: frozenset[int]) -> None:
        self.calls.append(("pin", cpus))


def _prefill_waiting(board: CoreBoard, slot: int) -> tuple[threading.Thread, threading.Event]:
    """A prefill forward on a thread of its own, returned once its busy flag is up; `entered` is set when the
    forward would start computing."""
    entered = threading.Event()

    def prefill() -> None:
        with board.prefilling(slot):
            entered.set()

    thread = threading.Thread(target=prefill)
    thread.start()
    deadline = time.monotonic() + 60
    while not board.prefill_busy():
        assert time.monotonic() < deadline, "the prefill worker never raised its flag"
        time.sleep(0.001)
    return thread, entered


def _cores(board: CoreBoard, recorder: _Recorder, slot: int = 0, extra: int | None = None) -> BorrowedCores:
    return BorrowedCores(board, slot, OWN, LENT, 1, recorder.threads, recorder.pin, extra_threads=extra)


def test_idle_prefill_lends_its_cores_and_busy_prefill_takes_them_back(board):
    """Idle board: the step runs on own + lent cores with a thread each (mask first, then threads), the flag
    is up during the step only. A busy prefill worker: the next step narrows back (threads first, then mask)
    and leaves the flag down. Settings change only when the choice does."""
    recorder = _Recorder()
    cores = _cores(board, recorder)
    cores.before_step()
    assert board.borrowing(0) and cores.wide_now
    assert recorder.calls == [("pin", frozenset({0, 1})), ("threads", 2)]
    cores.after_step()
    assert not board.borrowing(0)
    cores.before_step()
    cores.after_step()
    assert len(recorder.calls) == 2  # the same choice: nothing set again
    with board.prefilling(3):
        assert board.prefill_busy()
        cores.before_step()
        assert not board.borrowing(0) and not cores.wide_now
        cores.after_step()
    assert recorder.calls[2:] == [("threads", 1), ("pin", OWN)]
    assert not board.prefill_busy()
    assert (cores.steps, cores.borrowed_steps) == (3, 2)


def test_a_prefill_forward_waits_for_the_borrowing_step_to_end(board, monkeypatch):
    """With decode inside a borrowing step, a prefill worker raises its flag and does not start until the step
    ends (the cap is set far away here, so only the step's end can release it)."""
    monkeypatch.setattr(core_board, "LEND_BACK_WAIT_S", 120.0)
    cores = _cores(board, _Recorder())
    cores.before_step()  # borrowing
    thread, entered = _prefill_waiting(board, 0)
    assert not entered.is_set()
    cores.after_step()  # the step ends: its cores go back
    assert entered.wait(60)
    thread.join(60)
    cores.before_step()  # the prefill is done: the next step borrows again
    assert cores.wide_now


def test_the_wait_is_capped_when_decode_never_lowers_its_flag(board, monkeypatch):
    """A decode worker that died inside a borrowing step leaves its flag up: each prefill forward waits at
    most LEND_BACK_WAIT_S, then computes anyway."""
    monkeypatch.setattr(core_board, "LEND_BACK_WAIT_S", 0.01)
    board.set_borrowing(2, True)
    with board.prefilling(0) as waited:
        assert waited >= 0.01


def test_slots_and_boards_are_checked(board, tmp_path):
    with pytest.raises(ValueError, match="outside"):
        with board.prefilling(MAX_PREFILL_SLOTS):
            pass
    with pytest.raises(ValueError, match="outside"):
        _cores(board, _Recorder(), slot=MAX_DECODE_SLOTS)
    short = tmp_path / "short"
    short.write_bytes(b"\0" * 8)
    with pytest.raises(ValueError, match="not a board"):
        CoreBoard(str(short))
    with pytest.raises(FileNotFoundError):
        CoreBoard(str(tmp_path / "missing"))


def test_a_restarted_worker_clears_what_its_predecessor_left_up(board):
    """A prefill worker that died inside a forward leaves its byte up (no borrowing until it is cleared); a
    decode worker that died inside a borrowing step leaves the flag up: each successor clears its own."""
    board.set_busy(5, True)
    board.set_borrowing(1, True)
    _cores(board, _Recorder(), slot=1)
    assert not board.borrowing(1)
    assert board.prefill_busy()
    board.set_busy(5, False)
    assert not board.prefill_busy()


def test_several_decode_workers_borrow_by_mask_and_each_holds_prefill_back(board, monkeypatch):
    """Two decode workers sharing their own core, no extra threads (their share of one lent core): borrowing
    widens only the mask. A prefill forward waits while either of them is inside a borrowing step."""
    monkeypatch.setattr(core_board, "LEND_BACK_WAIT_S", 120.0)
    first, second = _Recorder(), _Recorder()
    cores = [_cores(board, first, slot=0, extra=0), _cores(board, second, slot=1, extra=0)]
    for each in cores:
        each.before_step()
    assert first.calls == second.calls == [("pin", frozenset({0, 1}))]
    cores[0].after_step()
    thread, entered = _prefill_waiting(board, 1)
    assert not entered.is_set()  # decode worker 1 still borrows
    cores[1].after_step()
    assert entered.wait(60)
    thread.join(60)


def _prefill_cores(board: CoreBoard, recorder: _Recorder, slot: int = 0) -> PrefillCores:
    return PrefillCores(board, slot, LENT, OWN, 1, recorder.threads, recorder.pin)  # the decode core lent to it


def test_prefill_borrows_the_decode_cores_while_decode_idles(board):
    """The other way: no decode worker active -> a prefill step runs on its own + the decode core with a thread
    more, its flag up between steps; a decode worker with work -> the next prefill step narrows back and lowers
    the flag; idle again -> it borrows again; done() hands the cores back."""
    recorder = _Recorder()
    cores = _prefill_cores(board, recorder)
    decode = _cores(board, _Recorder())
    cores.before_step()
    assert cores.wide_now and board.prefill_borrowing()
    assert recorder.calls == [("pin", frozenset({0, 1})), ("threads", 2)]
    board.set_active(0, True)
    cores.before_step()
    assert not cores.wide_now and not board.prefill_borrowing()
    assert recorder.calls[2:] == [("threads", 1), ("pin", LENT)]
    decode.idle()
    cores.before_step()
    assert cores.wide_now and board.prefill_borrowing()
    cores.done()
    assert not cores.wide_now and not board.prefill_borrowing()
    assert (cores.steps, cores.borrowed_steps) == (3, 2)


def test_a_decode_step_waits_for_the_borrowing_prefill_step_to_end(board, monkeypatch):
    """A decode worker that gets work while a prefill step borrows its core raises its flag and starts its step
    only when the prefill worker's next step boundary has handed the core back (the cap set far away here)."""
    monkeypatch.setattr(core_board, "GIVE_BACK_WAIT_S", 120.0)
    prefill = _prefill_cores(board, _Recorder())
    decode = _cores(board, _Recorder())
    prefill.before_step()  # borrowing: decode is idle
    stepped = threading.Event()
    thread = threading.Thread(target=lambda: (decode.before_step(), stepped.set()))
    thread.start()
    deadline = time.monotonic() + 60
    while not board.decode_active():
        assert time.monotonic() < deadline, "the decode worker never raised its flag"
        time.sleep(0.001)
    assert not stepped.is_set()
    prefill.before_step()  # the next prefill step sees decode active: narrows, the decode step starts
    assert stepped.wait(60)
    thread.join(60)
    assert not prefill.wide_now


def test_the_decode_wait_is_capped_when_prefill_never_lowers_its_flag(board, monkeypatch):
    """A prefill worker that died inside a borrowing step leaves its flag up: a decode step waits at most
    GIVE_BACK_WAIT_S, and once such a wait ran out the next steps do not wait at all (for STUCK_FLAG_IGNORE_S);
    the worker's successor clears the flag."""
    monkeypatch.setattr(core_board, "GIVE_BACK_WAIT_S", 0.01)
    board.set_prefill_borrowing(4, True)
    assert board.wait_prefill_returns() >= 0.01
    decode = _cores(board, _Recorder())
    decode.before_step()
    assert decode.ignore_prefill_until > 0
    waits = []
    monkeypatch.setattr(board, "wait_prefill_returns", lambda: waits.append(1) or 0.0)
    decode.after_step()
    decode.before_step()
    assert waits == []
    _prefill_cores(board, _Recorder(), slot=4)
    assert not board.prefill_borrowing()


def test_after_a_handoff_prefill_leaves_the_decode_cores_alone_until_decode_starts(board):
    """A batch that handed prompts off: the next prefill steps stay on their own cores (the new request's first
    decode step must not wait for a borrowing step) until a decode worker was seen active - then, once it idles
    again, borrowing resumes - or until HANDOFF_HOLD_S passed without decode starting."""
    now = [100.0]
    recorder = _Recorder()
    cores = PrefillCores(board, 0, LENT, OWN, 1, recorder.threads, recorder.pin, clock=lambda: now[0])
    decode = _cores(board, _Recorder())
    cores.done(handed_off=True)
    cores.before_step()
    assert not cores.wide_now and not board.prefill_borrowing()
    decode.before_step()  # the handed-off request starts decoding
    cores.before_step()
    decode.after_step()
    decode.idle()
    cores.before_step()  # seen active once: the hold is over
    assert cores.wide_now
    cores.done(handed_off=True)
    now[0] += core_board.HANDOFF_HOLD_S - 0.5
    cores.before_step()
    assert not cores.wide_now
    now[0] += 1.0  # decode never started (the request was dropped): borrowing resumes
    cores.before_step()
    assert cores.wide_now and cores.borrowed_steps == 2
