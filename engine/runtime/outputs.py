"""What the engine hands back: per-step outputs, prefill jobs and their results, the prefix cache's counters."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.sampling_params import SamplingParams
from engine.runtime.sequence import TokenLogprob


@dataclass
class StepOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_generated: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (not computed) for this request
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # with the first token, when params.prompt_logprobs is set


@dataclass(frozen=True)
class PrefillJob:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    page_ids: list[int]
    pool_names: tuple[str, ...] | None = None
    state_slot: int | None = None  # models with linear attention: the slot (of the pools named) the state goes to
    # the destination holds the prompt's first cached_tokens (whole pages) already: page_ids are the pages of the
    # tokens after them, and only those are exported (the state is exported whole)
    cached_tokens: int = 0


@dataclass(frozen=True)
class PrefillResult:
    request_id: str
    first_token: int
    first_logprobs: TokenLogprob | None
    num_prompt_tokens: int
    prefill_time_s: float
    num_cached_tokens: int = 0  # prompt tokens taken from the prefix cache (not computed)
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # params.prompt_logprobs set: prompt tokens 1 .. n-1


@dataclass
class PrefixCacheStats:
    """Counters and gauges of an engine's prefix cache (engine/cache/prefix_cache.py), since start.

    queried_tokens: prompt tokens looked up; hit_tokens: of those, served from cached pages;
    checkpoint_hits: lookups (KDA models) that restored a state checkpoint; cached_pages: pages the cache
    holds (in use or not); evictable_pages: of those, unreferenced (counted as free); evicted_pages;
    checkpoints / checkpoint_slots: KDA state checkpoints held / the checkpoint pool's size; evicted_checkpoints."""

    queried_tokens: int = 0
    hit_tokens: int = 0
    checkpoint_hits: int = 0
    cached_pages: int = 0
    evictable_pages: int = 0
    evicted_pages: int = 0
    checkpoints: int = 0
    checkpoint_slots: int = 0
    evicted_checkpoints: int = 0
