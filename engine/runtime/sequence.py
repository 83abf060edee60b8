"""One request's state inside the engine: tokens, cache progress, pages and sampling RNG."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.cache.kv_cache import PageTable
from engine.sampling_params import SamplingParams
from engine.spec.spec_policy import SpecState


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # needs (more) prefill
    RUNNING = "running"  # decoding
    FINISHED = "finished"


@dataclass
class TokenLogprob:
    """The chosen token's log-probability and the top-n alternatives (raw model distribution)."""

    token_id: int
    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass(frozen=True)
class KVDestination:
    """A prefill-only sequence's destination (engine/runtime/prefill_jobs.py): pages (and a state slot) in the pools named
    (None: this engine's own pool) that its prompt's KV is copied into when its prefill is done."""

    page_ids: tuple[int, ...]
    pool_names: tuple[str, ...] | None
    state_slot: int | None
    cached_tokens: int = 0  # the destination holds the prompt's first cached_tokens already: page_ids follow them


@dataclass(eq=False)
class Sequence:
    """Invariant while running: the cache holds every token but the last (num_cached == len(token_ids) - 1),
    for the target and, when a draft is loaded, for the draft's context too."""

    request_id: str
    prompt_len: int
    token_ids: list[int]
    params: SamplingParams
    page_table: PageTable
    spec_block_size: int = 0  # speculative block size for this request (last token + drafts); 0 = no speculation
    status: SeqStatus = SeqStatus.WAITING
    num_cached: int = 0
    generator: torch.Generator | None = None
    finish_reason: str | None = None
    new_tokens: list[int] = field(default_factory=list)  # emitted since the last StepOutput
    new_logprobs: list[TokenLogprob] = field(default_factory=list)
    arrival_order: int = 0
    state_slot: int | None = None  # the state-pool slot (models with linear attention), held while cached
    spec_state: SpecState = field(default_factory=SpecState)  # speculation back-off (engine/spec/spec_policy.py)
    grammar: Any = None  # structured output: engine.sampling.ops.grammar.GrammarMatcher over the tokens generated so far
    # params.prompt_logprobs set: entry i scores prompt token i + 1 (sent with the first token, then cleared)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    # Prefix cache (engine/cache/prefix_cache.py): prompt tokens its first admission took from the cache; a checkpoint
    # slot to restore into state_slot before its next prefill chunk; the key of its latest decode checkpoint;
    # the branch (KDA models): cached pages and keys past the restored checkpoint, referenced, swapped into the
    # page table when prefill reaches branch_end (engine/cache/prefix_reuse.py).
    num_cached_tokens: int = 0
    looked_up: bool = False
    restore_checkpoint: int | None = None
    branch_pages: tuple[int, ...] = ()
    branch_keys: tuple[bytes, ...] = ()
    decode_checkpoint: bytes | None = None
    export_to: KVDestination | None = None  # a prefill-only sequence: where its prompt's KV goes, then it ends

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    @property
    def branch_end(self) -> int:
        """Where the pending branch ends (0: none): its chunk ends there and the checkpoint is saved there."""
        if not self.branch_pages:
            return 0
        return (len(self.page_table.cache_keys) + len(self.branch_pages)) * self.page_table.page_size

    @property
    def remaining_prefill(self) -> int:
        """Tokens still to run through prefill (all but the last token are cached once it is done).

        Before the first token is sampled the whole prompt must be prefilled."""
        return self.prefill_target - self.num_cached

    @property
    def prefill_target(self) -> int:
        """The cache length prefill ends at: the prompt, or (recomputing after preemption) all but the last token."""
        return self.prompt_len if self.num_generated == 0 else self.num_tokens - 1
