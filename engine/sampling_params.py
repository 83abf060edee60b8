"""Per-request sampling settings, validated once at construction."""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy. top_k -1 (or 0) disables top-k; top_p 1.0 disables top-p;
    min_p 0.0 disables min-p. speculative: None follows the engine (on when a draft is loaded).
    block_size: speculative block size (last token + block_size - 1 drafts), None = the engine's
    (the engine also checks it against its own maximum). Every invalid field raises ValueError
    naming the field."""

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int = 0
    speculative: bool | None = None
    block_size: int | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.max_new_tokens) or self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if not _is_real(self.temperature) or self.temperature < 0 or math.isinf(self.temperature):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 0, got {self.top_k!r}")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or self.seed < 0):
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}")
        try:
            stop_token_ids = tuple(self.stop_token_ids)
        except TypeError:
            raise ValueError(f"stop_token_ids must be a sequence of token ids, got {self.stop_token_ids!r}") from None
        if not all(_is_int(token) and token >= 0 for token in stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if not _is_int(self.logprobs) or not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs!r}")
        if self.speculative is not None and not isinstance(self.speculative, bool):
            raise ValueError(f"speculative must be a bool or None, got {self.speculative!r}")
        if self.block_size is not None and (not _is_int(self.block_size) or self.block_size < 2):
            raise ValueError(f"block_size must be an integer >= 2, got {self.block_size!r}")
        object.__setattr__(self, "stop_token_ids", stop_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def speculates(params: Sequence[SamplingParams], has_draft: bool) -> bool:
    """Whether a forward over requests with these settings must store the draft model's context (its KV /
    hidden-state entries): only when a draft is loaded and some request may speculate. A request with
    speculative=False never reads its draft context (the engine decides per request, once, from the same
    field), so a batch of such requests skips the writes."""
    return has_draft and any(p.speculative is not False for p in params)
