"""The bookkeeping every load_weights shares: which expected tensors a checkpoint brought, which it brought
that the model does not know, and which had the wrong shape or dtype, collected so that ONE ValueError names
every offending tensor (nothing half-reported)."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Generic, TypeVar

from engine.weights.checkpoint import format_weight_errors

Spec = TypeVar("Spec")


class WeightCheck(Generic[Spec]):
    """expected: engine tensor name -> what the model expects of it (a shape, or (shape, dtype))."""

    def __init__(self, expected: Mapping[str, Spec]) -> None:
        self.expected = expected
        self.seen: set[str] = set()
        self.unexpected: list[str] = []
        self.misshaped: list[str] = []

    def expect(self, name: str | None, stored_name: str) -> Spec | None:
        """The spec of engine name `name`, which counts as seen; None (and `stored_name` recorded as
        unexpected) when the model has no such tensor."""
        spec = self.expected.get(name) if name is not None else None
        if spec is None:
            self.unexpected.append(stored_name)
            return None
        self.seen.add(name)
        return spec

    def mark_seen(self, name: str) -> None:
        """Counts `name` as seen when the model expects it (a tensor taken by another path, e.g. FP8)."""
        if name in self.expected:
            self.seen.add(name)

    def wrong_shape(self, stored_name: str, shape: tuple[int, ...], expected: object) -> None:
        self.misshaped.append(f"{stored_name} {shape} (expected {expected})")

    def raise_if_wrong(self, prefix: str = "", stored_name: Callable[[str], str] = str) -> None:
        """ValueError naming every missing (spelt by stored_name), unexpected and mis-shaped tensor."""
        missing = [stored_name(name) for name in sorted(set(self.expected) - self.seen)]
        if missing or self.unexpected or self.misshaped:
            raise ValueError(prefix + format_weight_errors(missing, self.unexpected, self.misshaped))
