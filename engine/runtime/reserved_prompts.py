"""A decode worker's reservation that starts from its own prefix cache (issue 34, decode-side reuse), seen from the
engine: the sequence a claimed reservation becomes.

At Reserve the engine's match_prompt maps the cached leading pages of the prompt (one reference each) and, for
models with KDA layers, pins the checkpoint of the last checkpointed one among them; the lease holds those pages
first, then new pages for the rest. A claim then makes it a sequence:
- add_prefilled (another worker prefilled it): every page; the first `cached_pages` are mapped as the cached
  ones (their keys), so the sequence's later publishing chains on from them and never writes them;
- add_local (the decode worker prefills it itself, no prefill hop): only the usable part of the hit - for KDA
  models the checkpointed part, whose state is restored into the sequence's slot before its first chunk - is
  mapped; hit pages past it become the sequence's branch, exactly as a scheduler lookup's (recomputed once into
  its own pages, swapped for the cached ones at the branch's end and checkpointed there: engine/cache/prefix_reuse.py),
  the new pages are kept and the engine's own Scheduler runs the rest as chunked prefill and samples the first token.
Either way each reference is given back exactly once: by the sequence (on success) or by the caller (on a
ValueError, nothing having changed)."""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from engine.runtime.sequence import Sequence

if TYPE_CHECKING:
    from engine.sampling_params import SamplingParams


class LocalEngine(Protocol):
    """What these functions use of LLMEngine."""

    config: Any
    prefix_cache: Any
    state_pool: Any
    scheduler: Any
    pool_lock: threading.RLock

    def validate_prompt(self, prompt_ids: list[int], params: SamplingParams | None = None) -> None: ...
    def new_sequence(self, request_id: str, prompt_ids: list[int], params: SamplingParams, pages=None) -> Sequence: ...
    def unpin_checkpoint(self, checkpoint: int) -> None: ...


class ReservedHit(NamedTuple):
    """What a reservation holds of the engine's prefix cache: page_ids[:cached_pages] are cached pages, and for KDA
    models `checkpoint` (pinned; None: none) holds the state after page_ids[:checkpoint_pages]."""

    cached_pages: int = 0
    checkpoint: int | None = None
    checkpoint_pages: int = 0


NO_HIT = ReservedHit()


class PromptReservation(NamedTuple):
    """What a decode worker's Reserve took: page_ids (the hit's cached pages first, then new ones), the state
    slot, and the hit."""

    page_ids: list[int]
    state_slot: int | None
    hit: ReservedHit = NO_HIT


def map_hit(engine: LocalEngine, seq: Sequence, cached_pages: int) -> None:
    """The sequence's first cached_pages pages are the prefix cache's: their keys, so publishing chains on."""
    if cached_pages and engine.prefix_cache is not None:
        seq.page_table.cache_keys = engine.prefix_cache.keys_of(seq.token_ids, cached_pages)
        seq.num_cached_tokens = cached_pages * engine.config.page_size


def usable_pages(hit: ReservedHit, has_state: bool) -> int:
    """Hit pages a local prefill can start after: all of them, or (KDA state) those up to the checkpoint."""
    if not has_state:
        return hit.cached_pages
    return hit.checkpoint_pages if hit.checkpoint is not None else 0


def add_local(engine: LocalEngine, request_id: str, prompt_ids: list[int], page_ids: list[int], params: SamplingParams,
              state_slot: int | None, hit: ReservedHit) -> None:
    """A reserved request the engine prefills itself from its usable hit (see the module doc). On success the
    sequence owns the pages, the slot and the checkpoint pin (given back once restored, or when it is dropped);
    on a ValueError the caller still does."""
    engine.validate_prompt(prompt_ids, params)
    size = engine.config.page_size
    if params.prompt_logprobs is not None:
        raise ValueError("prompt_logprobs are returned by the prefill service; this request needs a prefill worker")
    if len(page_ids) * size < len(prompt_ids) or not 0 <= hit.checkpoint_pages <= hit.cached_pages < len(page_ids):
        raise ValueError(f"{len(page_ids)} pages ({hit.cached_pages} cached) cannot hold a prompt of "
                         f"{len(prompt_ids)} tokens")
    has_state = engine.state_pool is not None
    if has_state != (state_slot is not None):
        raise ValueError("a request of a model with linear attention needs its state slot (and one without, none)")
    usable = usable_pages(hit, has_state)
    seq = engine.new_sequence(request_id, prompt_ids, params, pages=page_ids[:usable] + page_ids[hit.cached_pages:])
    with engine.pool_lock:
        map_hit(engine, seq, usable)
        seq.state_slot = state_slot
        seq.num_cached = usable * size
        seq.looked_up = True  # its lookup was the Reserve's
        if usable and has_state:
            seq.restore_checkpoint = hit.checkpoint  # pinned: unpinned once restored (or when the sequence drops it)
        elif hit.checkpoint is not None:
            engine.unpin_checkpoint(hit.checkpoint)
        if hit.cached_pages > usable:  # cached pages past the checkpoint: the sequence's branch (as a lookup's)
            seq.branch_pages = tuple(page_ids[usable : hit.cached_pages])
            seq.branch_keys = tuple(engine.prefix_cache.keys_of(seq.token_ids, hit.cached_pages)[usable:])
        engine.scheduler.add(seq)
