"""What every causal LM of the engine shares: the head-count check, the decoder body under `model`, the
vocab-parallel LM head (tied to the embedding when the config says so), embed() and compute_logits()."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from engine.attention.base import AttentionBackend
from engine.runtime.distributed import TPGroup
from engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from engine.layers.norm import RMSNorm
from engine.weights.checkpoint import iter_checkpoint


M = TypeVar("M", bound=nn.Module)


def materialize(model: nn.Module, device: torch.device) -> None:
    """A model built on the meta device -> uninitialised storage on `device` for load_weights to fill, with the
    buffers computed at construction (modules with init_buffers(): RoPE's inv_freq) computed again there."""
    model.to_empty(device=device)
    for module in model.modules():
        init_buffers = getattr(module, "init_buffers", None)
        if callable(init_buffers):
            init_buffers()


def build_and_load(model_cls: Callable[..., M], config: Any, tp: TPGroup, attention: AttentionBackend,
                   dtype: torch.dtype, device: torch.device | str, load: Callable[[M], None]) -> tuple[Any, M]:
    """What every load_model does: builds the rank's model with its tensors on `device`, `load(model)` copies
    the checkpoint in, and the model is left in eval mode without grads. -> (config, model)."""
    with torch.device(device):
        model = model_cls(config, tp, attention, dtype)
    load(model)
    model.eval().requires_grad_(False)
    return config, model


def checkpoint_loader(model_cls: Callable[..., M], config_cls: Any, elsewhere: Callable[[str, TPGroup, int], bool],
                      drop_mtp: bool) -> Callable[..., tuple[Any, M]]:
    """The registry's `load_model(model_dir, tp, attention, dtype, device="cpu") -> (config, model)` for a model
    whose load_weights takes the checkpoint's (stored name, tensor) pairs: config_cls.from_pretrained(model_dir),
    tensors for which elsewhere(stored name, tp, config.num_experts) holds are not read (experts another rank
    owns), drop_mtp drops the layers past config.num_hidden_layers."""

    def load_model(model_dir: str | Path, tp: TPGroup, attention: AttentionBackend, dtype: torch.dtype,
                   device: torch.device | str = "cpu") -> tuple[Any, M]:
        config = config_cls.from_pretrained(model_dir)
        layers = config.num_hidden_layers if drop_mtp else None

        def skip(name: str) -> bool:
            return elsewhere(name, tp, config.num_experts)

        return build_and_load(model_cls, config, tp, attention, dtype, device,
                              lambda model: model.load_weights(iter_checkpoint(model_dir, layers, skip=skip)))

    load_model.__doc__ = f"Reads config.json and the safetensors of model_dir into this rank's {model_cls.__name__}."
    return load_model


class DecoderStack(nn.Module):
    """The decoder body every model shares: embed_tokens, `layers` (layer_cls(config, index, tp, attention,
    dtype) for each of config.num_hidden_layers) and the final norm; a model adds what its own needs."""

    def __init__(self, config: Any, tp: TPGroup, attention: AttentionBackend, dtype: torch.dtype,
                 layer_cls: Callable[..., nn.Module]) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp, dtype)
        self.layers = nn.ModuleList(layer_cls(config, i, tp, attention, dtype) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)


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
