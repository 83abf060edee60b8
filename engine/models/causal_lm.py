"""What every causal LM of the engine shares: the head-count check, the decoder body under `model`, the
vocab-parallel LM head (tied to the embedding when the config says so), embed() and compute_logits()."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn

from engine.attention.base import AttentionBackend
from engine.distributed import TPGroup
from engine.layers.embedding import ParallelLMHead


M = TypeVar("M", bound=nn.Module)


def build_and_load(model_cls: Callable[..., M], config: Any, tp: TPGroup, attention: AttentionBackend,
                   dtype: torch.dtype, device: torch.device | str, load: Callable[[M], None]) -> tuple[Any, M]:
    """What every load_model does: builds the rank's model with its tensors on `device`, `load(model)` copies
    the checkpoint in, and the model is left in eval mode without grads. -> (config, model)."""
    with torch.device(device):
        model = model_cls(config, tp, attention, dtype)
    load(model)
    model.eval().requires_grad_(False)
    return config, model


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
