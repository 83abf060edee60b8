"""Tiny random Kimi Linear checkpoints written by transformers' KimiLinearForCausalLM, and a runner that
drives an engine model with linear-attention state (paged latent cache + state pool, one slot per sequence).

Variants (all float32, seed-fixed, non-zero router correction bias):
  base     4 layers (KDA, KDA, KDA, MLA), plain q_proj, 8 experts top-2
  q_lora   5 layers (KDA, MLA, KDA, KDA, MLA), q_lora, 2 dense layers first, 2 expert groups, 2 shared experts
  heads24  4 layers (KDA, MLA, KDA, MLA), 24 MLA heads (12 per rank at TP=2, padded to 16), 6 KDA heads
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

KIMI_VARIANTS = ("base", "q_lora", "heads24")

_BASE: dict[str, Any] = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16,
    v_head_dim=16, num_local_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
    routed_scaling_factor=2.446, initializer_range=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    tie_word_embeddings=False,
)
_VARIANTS: dict[str, dict[str, Any]] = {
    "base": dict(linear_attn_config={"head_dim": 16, "num_heads": 4, "short_conv_kernel_size": 4,
                                     "kda_layers": [1, 2, 3], "full_attn_layers": [4]}),
    "q_lora": dict(num_hidden_layers=5, q_lora_rank=24, first_k_dense_replace=2, n_group=2, topk_group=1,
                   n_shared_experts=2, routed_scaling_factor=1.5,
                   linear_attn_config={"head_dim": 8, "num_heads": 4, "short_conv_kernel_size": 4,
                                       "kda_layers": [1, 3, 4], "full_attn_layers": [2, 5]}),
    "heads24": dict(num_attention_heads=24, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                    linear_attn_config={"head_dim": 8, "num_heads": 6, "short_conv_kernel_size": 3,
                                        "kda_layers": [1, 3], "full_attn_layers": [2, 4]}),
}


def make_kimi_checkpoint(tmp_dir: str | Path, variant: str, seed: int = 0) -> Path:
    """transformers' KimiLinearForCausalLM, fixed seed, save_pretrained (float32) under tmp_dir/kimi-variant-seed."""
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    if variant not in _VARIANTS:
        raise ValueError(f"unknown Kimi variant {variant!r}; choose from {KIMI_VARIANTS}")
    out = Path(tmp_dir) / f"kimi-{variant}-{seed}"
    if (out / "config.json").exists():
        return out
    torch.manual_seed(seed)
    kwargs = {**_BASE, **_VARIANTS[variant]}
    kwargs["num_key_value_heads"] = kwargs["num_attention_heads"]
    model = KimiLinearForCausalLM(KimiLinearConfig(**kwargs)).float().eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=generator) * 0.05)
    model.save_pretrained(out)
    return out


def hf_logits(model_dir: Path, token_ids: list[int]) -> torch.Tensor:
    """transformers' float32 logits [len, vocab] of one sequence (eager attention)."""
    from transformers import KimiLinearForCausalLM

    model = KimiLinearForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float()


class StatefulRunner:
    """Drives an engine model over sequences that grow step by step; each sequence owns one state slot.

    step(mode, [(seq, tokens), ...]) -> (float32 logits [num_new_tokens, vocab], ModelOutput)."""

    def __init__(self, model: Any, config: Any, num_pages: int = 64, page_size: int = 16, num_slots: int = 8) -> None:
        from engine.cache.kv_cache import CacheShape, PageAllocator, PagedLatentCache
        from engine.cache.state_pool import StatePool

        shape = CacheShape(config.num_cache_layers, num_pages, page_size, config.kv_lora_rank,
                           config.qk_rope_head_dim, model.dtype)
        state = StatePool(config.state_shape(model.tp.size, num_slots, model.dtype))
        self.model = model
        self.cache = PagedLatentCache(shape, state=state)
        self.allocator = PageAllocator(num_pages)
        self.allocator.allocate(1)  # page 0 stays unused
        self.page_size = page_size
        self.tables: dict[int, Any] = {}
        self.lengths: dict[int, int] = {}
        self.slots: dict[int, int] = {}

    def step(self, mode: Any, chunks: list[tuple[int, list[int]]]) -> tuple[torch.Tensor, Any]:
        from engine.runtime.forward_batch import ForwardBatch, build_attention_metadata
        from engine.cache.kv_cache import PageTable

        q_lens, kv_lens, pages, ids, positions, slots = [], [], [], [], [], []
        for seq, tokens in chunks:
            table = self.tables.setdefault(seq, PageTable(self.allocator, self.page_size))
            if seq not in self.slots:
                self.slots[seq] = self.cache.state.alloc()
            start = self.lengths.get(seq, 0)
            table.ensure(start + len(tokens))
            self.lengths[seq] = start + len(tokens)
            q_lens.append(len(tokens))
            kv_lens.append(start + len(tokens))
            pages.append(list(table.pages))
            slots.append(self.slots[seq])
            ids += tokens
            positions += range(start, start + len(tokens))
        metadata = build_attention_metadata(q_lens, kv_lens, pages, self.page_size)
        batch = ForwardBatch(mode, torch.tensor(ids), torch.tensor(positions), metadata,
                             state_slots=torch.tensor(slots, dtype=torch.int64))
        with torch.no_grad():
            out = self.model(batch, self.cache)
            return self.model.compute_logits(out.hidden), out

    def state_of(self, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cache.state.read_slot(self.slots[seq])
