"""HeldObserver: a run's metrics held back, then made on the real observer in order, values unchanged."""
from __future__ import annotations

from gateway.held_observer import HeldObserver


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple]] = []

    def __getattr__(self, name: str):
        return lambda *args: self.calls.append((name, args))


def test_release_makes_every_held_call_in_order_and_returns_the_observer():
    """Nothing reaches the observer until release(); then each call, with its own arguments, in the order
    made; release() returns the observer itself and holds nothing more."""
    recorder = _Recorder()
    held = HeldObserver(recorder)
    held.admitted(0.5, 128, spare=True)
    held.prefilled(0.25)
    held.first_token(0.75)
    held.tokens(1, None)
    held.decode_started(0.01)
    held.finished(1.5, 3, 4)
    assert recorder.calls == []
    assert held.release() is recorder
    assert recorder.calls == [("admitted", (0.5, 128, True)), ("prefilled", (0.25,)), ("first_token", (0.75,)),
                              ("tokens", (1, None)), ("decode_started", (0.01,)), ("finished", (1.5, 3, 4))]
    assert held.release() is recorder and len(recorder.calls) == 6  # released calls are not made twice
