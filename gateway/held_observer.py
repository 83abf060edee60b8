"""A request's metrics held back while its first token is on the way (issue 18: nothing but the token on
the first token's path), then handed to the real observer in the order they happened."""
from __future__ import annotations

from typing import Generic, TypeVar

Observer = TypeVar("Observer")  # a RunObserver (gateway.orchestrator)


class HeldObserver(Generic[Observer]):
    """Takes a RunObserver's calls (gateway.orchestrator) and keeps them until release(), which makes them
    on `observer`, in order, and returns it: the run then reports to the observer itself. The durations
    are taken when the run calls, so holding changes none of the values, only when they are recorded."""

    def __init__(self, observer: Observer) -> None:
        self._observer = observer
        self._calls: list[tuple[str, tuple[float | int | bool | str | None, ...]]] = []

    def admitted(self, queue_s: float, prompt_tokens: int, spare: bool = False) -> None:
        self._calls.append(("admitted", (queue_s, prompt_tokens, spare)))

    def prefilled(self, prefill_s: float) -> None:
        self._calls.append(("prefilled", (prefill_s,)))

    def decode_started(self, setup_s: float) -> None:
        self._calls.append(("decode_started", (setup_s,)))

    def first_token(self, ttft_s: float) -> None:
        self._calls.append(("first_token", (ttft_s,)))

    def tokens(self, count: int, gap_s: float | None) -> None:
        self._calls.append(("tokens", (count, gap_s)))

    def finished(self, e2e_s: float, decode_steps: int, decode_tokens: int) -> None:
        self._calls.append(("finished", (e2e_s, decode_steps, decode_tokens)))

    def cache_routed(self, role: str, expected: int, actual: int | None) -> None:
        self._calls.append(("cache_routed", (role, expected, actual)))

    def release(self) -> Observer:
        """Makes the held calls on the observer, in the order they came, and returns the observer."""
        calls, self._calls = self._calls, []
        for name, args in calls:
            getattr(self._observer, name)(*args)
        return self._observer
