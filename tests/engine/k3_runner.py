"""Drives a hybrid (KDA + MLA) engine model over growing sequences: a paged latent cache for the MLA
layers plus a state pool with one slot per sequence, as the runtime will (prefill chunks, decode steps)."""
from __future__ import annotations

from typing import Any

import torch

from engine.runtime.forward_batch import ForwardBatch, ForwardMode, build_attention_metadata
from engine.cache.kv_cache import CacheShape, PageAllocator, PagedLatentCache, PageTable
from engine.cache.state_pool import StatePool


class HybridRunner:
    """step(mode, [(seq, tokens), ...]) -> (float32 logits [new tokens, vocab], ModelOutput)."""

    def __init__(self, model: Any, num_pages: int = 64, page_size: int = 16, num_slots: int = 4) -> None:
        config = model.config
        shape = CacheShape(max(config.num_cache_layers, 1), num_pages, page_size, config.kv_lora_rank,
                           config.qk_rope_head_dim, model.dtype)
        state = None
        if config.has_linear_attention:
            state = StatePool(config.state_shape(model.tp.size, num_slots, torch.float32))
        self.model = model
        self.cache = PagedLatentCache(shape, state=state)
        self.allocator = PageAllocator(num_pages)
        self.allocator.allocate(1)  # page 0 stays unused, so a zero block-table entry is never real context
        self.page_size = page_size
        self.tables: dict[int, Any] = {}
        self.lengths: dict[int, int] = {}
        self.slots: dict[int, int] = {}

    def slot(self, seq: int) -> int:
        if seq not in self.slots:
            self.slots[seq] = self.cache.state.alloc() if self.cache.state is not None else 0
        return self.slots[seq]

    def step(self, mode: ForwardMode, chunks: list[tuple[int, list[int]]], capture_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, Any]:
        q_lens, kv_lens, pages, ids, positions, slots = [], [], [], [], [], []
        for seq, tokens in chunks:
            table = self.tables.setdefault(seq, PageTable(self.allocator, self.page_size))
            start = self.lengths.get(seq, 0)
            table.ensure(start + len(tokens))
            self.lengths[seq] = start + len(tokens)
            q_lens.append(len(tokens))
            kv_lens.append(start + len(tokens))
            pages.append(list(table.pages))
            ids += tokens
            positions += range(start, start + len(tokens))
            slots.append(self.slot(seq))
        metadata = build_attention_metadata(q_lens, kv_lens, pages, self.page_size)
        batch = ForwardBatch(mode, torch.tensor(ids), torch.tensor(positions), metadata,
                             state_slots=torch.tensor(slots, dtype=torch.int64))
        with torch.no_grad():
            out = self.model(batch, self.cache, capture_layers)
            return self.model.compute_logits(out.hidden), out

    def state_of(self, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv, recurrent) copies of a sequence's slot."""
        return self.cache.state.read_slot(self.slots[seq])
