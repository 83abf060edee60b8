"""The base of the prefill tests' fake engines: a prefill_worker.engine_api.PrefillEngine (checked when built)
for the shm transport, whose prefill writes straight into the decode pool's pages, so it holds no pages of
its own (local reservations, page and state copies are refused). Subclasses say what prefill answers."""
from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import torch

from engine.runtime.outputs import PrefillJob, PrefillResult
from kvtransfer.layout import KVLayout
from prefill_worker.engine_api import PageCopies, PrefillEngine


class InPlaceEngine:
    def __init__(self, layout: KVLayout) -> None:
        self.config = SimpleNamespace(tp_size=1, page_size=layout.page_size)
        self.cache_shape = layout.to_cache_shape(8)
        assert isinstance(self, PrefillEngine), "the fake lacks a member of PrefillEngine"

    def validate_prompt(self, prompt_ids: list[int]) -> None:
        pass

    def prefill(self, jobs: list[PrefillJob],
                should_stop: Callable[[str], bool] | None = None) -> list[PrefillResult | None]:
        raise NotImplementedError

    def allocate_reservation(self, num_tokens: int) -> tuple[list[int], int | None]:
        raise ValueError("this fake engine writes in place only (shm)")

    def free_reservation(self, page_ids: list[int], state_slot: int | None) -> None:
        raise ValueError("this fake engine holds no pages")

    def read_pages(self, page_ids: list[int]) -> PageCopies:
        raise ValueError("this fake engine holds no pages")

    def read_state(self, slot: int) -> torch.Tensor:
        raise ValueError("this fake engine holds no state slots")

    def close(self) -> None:
        pass
