"""What every causal LM of the engine shares: the head-count check, the decoder body under `model`, the
vocab-parallel LM head (tied to the embedding when the config says so), embed() and compute_logits()."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from engine.attention.base import AttentionBackend
from engine.distributed import TPGroup
from engine.layers.embedding import ParallelLMHead


class CausalLM(nn.Module):
    """One tensor-parallel rank. `body(config, tp, attention, dtype)` builds the decoder (with
    `embed_tokens`); uses_attention False skips the head-count check (a model without MLA layers)."""

    def __init__(self, config: Any, tp: TPGroup, attention: AttentionBackend, dtype: torch.dtype,
                 body: Callable[..., nn.Module], uses_attention: bool = True) -> None:
        super().__init__()
        config.validate_tp(tp.size)
        heads = config.num_attention_heads // tp.size
        if uses_attention and not attention.supports_num_heads(heads):
            raise ValueError(f"attention backend {attention.name!r} does not run {heads} heads per rank")
        self.config = config
        self.tp = tp
        self.dtype = dtype
        self.model = body(config, tp, attention, dtype)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp, dtype)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [T] -> [T, hidden] (no scaling)."""
        return self.model.embed_tokens(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> [N, vocab] float32, full vocabulary on every rank."""
        return self.lm_head(hidden)
