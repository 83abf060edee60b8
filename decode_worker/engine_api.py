"""What the decode worker uses of its engine, as Protocols: the figures it reads (EngineFigures: an LLMEngine,
or in the worker the engine process's EngineView), what runs it where it lives (DecodeEngine: the LLMEngine in
the engine process, or on a test's thread), and where it runs (EnginePort: process_port.ProcessPort; tests
run it on a thread of their own). Test fakes implement these, so renaming an engine member breaks them.
LoadSnapshot: the figures as the worker reports them (GetDecodeLoad, metrics), read by snapshot_of."""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from decode_worker.admission import headroom

if TYPE_CHECKING:
    import torch

    from engine.engine_config import EngineConfig
    from engine.runtime.outputs import PrefixCacheStats, StepOutput
    from engine.cache.kv_cache import CacheShape
    from engine.sampling_params import SamplingParams
    from engine.cache.prefix_cache import PrefixHit
    from engine.runtime.reserved_prompts import PromptReservation, ReservedHit


class ContextLimit(Protocol):
    """Of the model config: the longest context (a request's prompt + output must fit)."""

    max_position_embeddings: int


class PoolSize(Protocol):
    """Of the page allocator: the pages in the pool."""

    num_pages: int


class Acceptance(Protocol):
    """Of the speculative acceptance counters: what the worker's metrics read."""

    num_verify_steps: int
    num_drafts: int
    num_accepted_drafts: int


@runtime_checkable
class EngineFigures(Protocol):
    """What the worker reads of its engine: the facts fixed when it was built and its current figures."""

    config: EngineConfig
    cache_shape: CacheShape
    pool_names: tuple[str, ...]
    device: torch.device
    model_config: ContextLimit
    allocator: PoolSize
    num_state_slots: int
    num_free_pages: int
    num_free_state_slots: int
    num_running: int
    num_waiting: int
    num_preemptions: int
    acceptance_stats: Acceptance
    prefix_cache_stats: PrefixCacheStats  # all zero without a prefix cache


@runtime_checkable
class DecodeEngine(EngineFigures, Protocol):
    """The engine where it runs: stepped by decode_worker/step_loop.py, reserved from by leases.allocate_admitted."""

    pool_lock: threading.RLock

    def has_work(self) -> bool: ...
    def step(self) -> list[StepOutput]: ...
    def add_prefilled(self, request_id: str, prompt_ids: list[int], first_token: int, page_ids: list[int],
                      params: SamplingParams, state_slot: int | None = None) -> None: ...
    def abort(self, request_id: str) -> bool: ...
    def allocate_reservation(self, num_tokens: int) -> tuple[list[int], int | None]: ...
    def free_reservation(self, page_ids: list[int], state_slot: int | None) -> None: ...
    def match_prompt(self, prompt_ids: list[int]) -> PrefixHit: ...
    def unpin_checkpoint(self, checkpoint: int) -> None: ...
    def add_local_prefill(self, request_id: str, prompt_ids: list[int], page_ids: list[int], params: SamplingParams,
                          state_slot: int | None = None, hit: ReservedHit = ...) -> None: ...


@runtime_checkable
class EnginePort(Protocol):
    """Where the engine runs, as the DecodeService uses it: start / stop, load figures, reservations allocated
    without waiting for a step, add / abort between steps; step outputs go to the service's Streams."""

    engine_steps: int  # steps that produced output, and the tokens they produced
    engine_step_tokens: int

    async def start(self) -> EngineFigures: ...
    async def stop(self) -> None: ...
    def snapshot(self) -> LoadSnapshot: ...
    async def allocate(self, num_tokens: int, pending: int = 0,
                       prompt_ids: list[int] | None = None) -> PromptReservation: ...
    def free(self, page_ids: list[int], state_slot: int | None, checkpoint: int | None = None) -> None: ...
    async def add(self, request_id: str, prompt_ids: list[int], first_token: int, page_ids: list[int],
                  params: SamplingParams, state_slot: int | None, hit: ReservedHit = ...,
                  local: bool = False) -> None: ...
    def abort_soon(self, request_id: str) -> None: ...
    async def abort(self, request_id: str) -> None: ...


@dataclass(frozen=True)
class LoadSnapshot:
    free_pages: int = 0
    total_pages: int = 0
    running: int = 0
    waiting: int = 0
    leases: int = 0
    leased_pages: int = 0
    page_size: int = 16
    tp_size: int = 1
    headroom_pages: int = 0
    requests_total: int = 0
    free_state_slots: int = 0  # linear attention: state slots neither used nor leased (0 for pure MLA)
    total_state_slots: int = 0
    standing_leases: int = 0  # of `leases`: unclaimed standing leases (gateways' spares)
    standing_pages: int = 0  # of `leased_pages`: the pages they hold
    standing_state_slots: int = 0  # the state slots they hold
    checkpoints: int = 0  # recurrent-state checkpoints the prefix cache holds (0 without one)
    checkpoint_slots: int = 0  # the prefix cache's checkpoint pool size (0 without one)
    cached_pages: int = 0  # pages the prefix cache holds, in use or not (0 without one)
    prefix_queried_tokens: int = 0  # prompt tokens looked up in the prefix cache since start
    prefix_hit_tokens: int = 0  # of those, served from cached pages


def snapshot_of(engine: EngineFigures, spec_block_size: int) -> LoadSnapshot:
    """The engine's figures now (an LLMEngine, or a process port's EngineView)."""
    running, page_size = engine.num_running, engine.config.page_size
    cache = engine.prefix_cache_stats
    return LoadSnapshot(
        free_pages=engine.num_free_pages, total_pages=engine.allocator.num_pages, running=running,
        waiting=engine.num_waiting, page_size=page_size, tp_size=engine.config.tp_size,
        headroom_pages=headroom(running, spec_block_size, page_size),
        free_state_slots=engine.num_free_state_slots, total_state_slots=engine.num_state_slots,
        checkpoints=cache.checkpoints, checkpoint_slots=cache.checkpoint_slots, cached_pages=cache.cached_pages,
        prefix_queried_tokens=cache.queried_tokens, prefix_hit_tokens=cache.hit_tokens,
    )
