"""When speculation stops paying for a sequence: back off to plain decode steps, then probe again.

A speculative step (draft forward + verify forward over the block) costs more than a plain decode step - on
CPU about 2x for the embedded models (benchmarks/profile_spec.py), on a GPU little more than 1x - so it pays
only while it emits more tokens per step than that cost ratio. SpecBackoff keeps, per sequence, an
exponential moving average of the tokens each verify step emitted (accepted drafts + the bonus token); when
it falls below `min_tokens_per_step` the sequence decodes plainly for `first_backoff` steps, then runs one
speculative probe step; a probe that still falls short doubles the back-off (up to `max_backoff`), one that
pays resets it. The draft context keeps being written during plain steps (the request still speculates), so
a probe drafts from a complete context.

Exactness does not depend on the policy: a plain step samples from the target's distribution and a verify
step keeps it (greedy: the same tokens either way), so output is the same whatever the policy decides.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SpecBackoff:
    """min_tokens_per_step <= 1 disables the back-off (a verify step always emits >= 1 token)."""

    min_tokens_per_step: float = 0.0
    ema_weight: float = 0.5  # weight of the newest verify step in the moving average
    first_backoff: int = 2
    max_backoff: int = 32

    def __post_init__(self) -> None:
        if not self.min_tokens_per_step >= 0.0:
            raise ValueError(f"min_tokens_per_step must be >= 0, got {self.min_tokens_per_step!r}")
        if not 0.0 < self.ema_weight <= 1.0:
            raise ValueError(f"ema_weight must be in (0, 1], got {self.ema_weight!r}")
        if not 1 <= self.first_backoff <= self.max_backoff:
            raise ValueError(f"need 1 <= first_backoff <= max_backoff, got {self.first_backoff}, {self.max_backoff}")

    @property
    def enabled(self) -> bool:
        return self.min_tokens_per_step > 1.0


@dataclass
class SpecState:
    """One sequence's speculation history: the moving average of tokens per verify step (None before the
    first), plain steps left before the next probe, and the current back-off length (0: not backing off)."""

    tokens_per_step: float | None = None
    skip: int = 0
    backoff: int = 0


def should_speculate(policy: SpecBackoff, state: SpecState) -> bool:
    """Whether this step drafts for the sequence; a skipped step counts down the back-off."""
    if not policy.enabled or state.skip == 0:
        return True
    state.skip -= 1
    return False


def record_verify(policy: SpecBackoff, state: SpecState, tokens: int) -> None:
    """After a verify step that emitted `tokens` (accepted drafts + 1) for the sequence."""
    if not policy.enabled:
        return
    previous = state.tokens_per_step
    average = tokens if previous is None else policy.ema_weight * tokens + (1 - policy.ema_weight) * previous
    if average >= policy.min_tokens_per_step:
        state.tokens_per_step, state.backoff = average, 0
        return
    state.backoff = policy.first_backoff if state.backoff == 0 else min(policy.max_backoff, 2 * state.backoff)
    state.skip = state.backoff
    # The probe after the back-off is judged from the threshold, not from the history that caused it.
    state.tokens_per_step = policy.min_tokens_per_step
