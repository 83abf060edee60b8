"""What the prefill worker uses of its engine, as a Protocol: an LLMEngine; test fakes implement it (and check
so), so renaming an engine member breaks them."""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from engine.engine_config import EngineConfig
    from engine.runtime.outputs import PrefillJob, PrefillResult
    from engine.cache.kv_cache import CacheShape

PageCopies = tuple["torch.Tensor", "torch.Tensor | None"]  # (target [layers, n, page_size, D], draft or None)


@runtime_checkable
class PrefillEngine(Protocol):
    """The engine on the prefill worker's engine thread: prompts prefilled into given pages (the decode pool's,
    or local ones whose copies are then pushed), with the local reservations that takes."""

    config: EngineConfig
    cache_shape: CacheShape

    def validate_prompt(self, prompt_ids: list[int]) -> None: ...
    def prefill(self, jobs: list[PrefillJob], should_stop: Callable[[str], bool] | None = None,
                before_step: Callable[[], None] | None = None) -> list[PrefillResult | None]: ...
    def allocate_reservation(self, num_tokens: int) -> tuple[list[int], int | None]: ...
    def free_reservation(self, page_ids: list[int], state_slot: int | None) -> None: ...
    def read_pages(self, page_ids: list[int]) -> PageCopies: ...
    def read_state(self, slot: int) -> torch.Tensor: ...
