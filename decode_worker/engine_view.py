"""The decode engine as a worker with an engine process sees it (decode_worker/process_port.py): the facts
fixed when the engine was built and the figures of the engine process's latest message, under the names
LLMEngine gives them, so the reservation book, the KV receivers, load reports and metrics read either."""
from __future__ import annotations

from dataclasses import dataclass

from decode_worker.engine_process import EngineFacts, Load


@dataclass(frozen=True)
class _Limits:
    max_position_embeddings: int = 0
    num_pages: int = 0


@dataclass(frozen=True)
class _Acceptance:
    num_verify_steps: int = 0
    num_drafts: int = 0
    num_accepted_drafts: int = 0


class EngineView:
    """The engine as the worker sees it: the facts fixed at its start (config, cache shape, pool names,
    device, limits) and the figures of its latest message (the names LLMEngine gives them)."""

    def __init__(self, facts: EngineFacts) -> None:
        self.config, self.cache_shape, self.device = facts.config, facts.cache_shape, facts.device
        self.pool_names = facts.pool_names
        self.model_config = _Limits(max_position_embeddings=facts.max_context)
        self.allocator = _Limits(num_pages=facts.num_pages)
        self.num_state_slots = facts.num_state_slots
        self.update(facts.load)

    def update(self, load: Load) -> None:
        self.num_free_pages, self.num_free_state_slots = load.free_pages, load.free_state_slots
        self.num_running, self.num_waiting, self.num_preemptions = load.running, load.waiting, load.preemptions
        self.acceptance_stats = _Acceptance(load.verify_steps, load.draft_tokens, load.accepted_drafts)
        self.prefix_cache_stats = load.prefix_cache
        self.borrowed_steps = load.borrowed_steps
