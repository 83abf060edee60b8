"""Multi-head latent attention (MLA), heads split over tensor-parallel ranks.

Every rank computes the same latent c_kv = kv_a_layernorm(kv_a_proj_with_mqa(x)[:kv_lora_rank]) and
k_pe = rope(kv_a_proj_with_mqa(x)[kv_lora_rank:]) and writes cat(c_kv, k_pe) into its paged cache
first. Then, by batch mode:
  EXTEND (MHA form): the context latent is decompressed through kv_b_proj into per-head k_nope / v;
  DECODE (absorbed form): W_UK is folded into q, attention runs over the latent cache directly, and
  W_UV is applied to the latent output.

Variants chosen by constructor flags (Kimi Linear / Kimi K3):
  use_rope=False (NoPE, config mla_use_nope): the 64-dim "rope" parts of q and k are computed, cached
    and used in the scores, but never rotated; positions never enter the layer.
  output_gate=True (config mla_use_output_gate): o <- o * sigmoid(g_proj(x)) per head before o_proj,
    where x is the attention input; g_proj [num_heads * v_head_dim, hidden] is column-parallel.
  latent_norm_eps: eps of q_a_layernorm / kv_a_layernorm (transformers' deepseek_v3 and kimi_linear use
    1e-6; Kimi K3 uses rms_norm_eps).
layer_index is the index of this layer's pages in the cache: for hybrid models it is the MLA ordinal
(0 for the first MLA layer), not the decoder-layer index.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.attention.base import AttentionBackend, VarlenSpans
from engine.model_configs.base import MLAShape
from engine.runtime.distributed import TPGroup
from engine.runtime.forward_batch import AttentionMetadata, ForwardBatch, ForwardMode
from engine.cache.kv_cache import PagedLatentCache
from engine.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding

# transformers builds q_a_layernorm / kv_a_layernorm with the RMSNorm default eps, not rms_norm_eps.
LATENT_NORM_EPS = 1e-6


def context_slots(attn: AttentionMetadata) -> torch.Tensor:
    """Cache slots [sum(kv_lens)] of every sequence's whole context, sequence after sequence."""
    page_size = attn.page_size
    rows, positions = [], []
    for i, kv_len in enumerate(attn.kv_lens_cpu):
        positions.append(torch.arange(kv_len, device=attn.block_table.device))
        rows.append(torch.full((kv_len,), i, dtype=torch.long, device=attn.block_table.device))
    pos, row = torch.cat(positions), torch.cat(rows)
    pages = attn.block_table.long()[row, pos // page_size]
    return pages * page_size + pos % page_size


class MLAAttention(nn.Module):
    """x [T, hidden] -> [T, hidden] (all-reduced over ranks); num_heads / tp heads on this rank."""

    def __init__(
        self, config: MLAShape, layer_index: int, tp: TPGroup, attention: AttentionBackend, dtype: torch.dtype,
        *, use_rope: bool = True, output_gate: bool = False, latent_norm_eps: float = LATENT_NORM_EPS,
    ) -> None:
        super().__init__()
        c = config
        self.layer_index = layer_index
        self.attention = attention
        self.num_local_heads = c.num_attention_heads // tp.size
        self.nope_dim, self.rope_dim, self.v_dim = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        self.kv_lora_rank = c.kv_lora_rank
        self.softmax_scale = c.softmax_scale
        q_out = c.num_attention_heads * c.qk_head_dim
        self.use_q_lora = c.q_lora_rank is not None
        if not self.use_q_lora:
            self.q_proj = ColumnParallelLinear(c.hidden_size, q_out, tp, dtype)
        else:
            self.q_a_proj = ReplicatedLinear(c.hidden_size, c.q_lora_rank, dtype)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, latent_norm_eps, dtype)
            self.q_b_proj = ColumnParallelLinear(c.q_lora_rank, q_out, tp, dtype)
        self.kv_a_proj_with_mqa = ReplicatedLinear(c.hidden_size, c.kv_cache_dim, dtype)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, latent_norm_eps, dtype)
        self.kv_b_proj = ColumnParallelLinear(c.kv_lora_rank, c.num_attention_heads * (c.qk_nope_head_dim + c.v_head_dim), tp, dtype)
        self.o_proj = RowParallelLinear(c.num_attention_heads * c.v_head_dim, c.hidden_size, tp, dtype)
        self.use_rope = use_rope
        self.rotary = RotaryEmbedding(c.rope, c.qk_rope_head_dim, c.rope_interleave) if use_rope else None  # type: ignore[attr-defined]
        self.output_gate = output_gate
        if output_gate:
            self.g_proj = ColumnParallelLinear(c.hidden_size, c.num_attention_heads * c.v_head_dim, tp, dtype)
        # Absorbed-form weights, filled by process_weights_after_loading().
        self.register_buffer("w_uk", torch.empty(0, dtype=dtype), persistent=False)  # [H, nope, kv_lora_rank]
        self.register_buffer("w_uv_t", torch.empty(0, dtype=dtype), persistent=False)  # [H, kv_lora_rank, v]

    def process_weights_after_loading(self) -> None:
        """Splits kv_b_proj [H*(nope+v), kv_lora_rank] into W_UK and W_UV^T for the absorbed form."""
        w = self.kv_b_proj.weight.view(self.num_local_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        self.w_uk = w[:, : self.nope_dim, :].contiguous()
        self.w_uv_t = w[:, self.nope_dim :, :].transpose(1, 2).contiguous()

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: PagedLatentCache) -> torch.Tensor:
        num_tokens = x.shape[0]
        if self.use_q_lora:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        q = q.view(num_tokens, self.num_local_heads, self.nope_dim + self.rope_dim)
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv)
        if self.rotary is not None:
            q_pe, k_pe = self.rotary(batch.positions, q_pe, k_pe)
        latent = torch.cat([c_kv, k_pe], dim=-1)  # [T, kv_lora_rank + rope]
        kv_cache = cache.layer(self.layer_index)
        kv_cache.view(-1, kv_cache.shape[-1]).index_copy_(0, batch.attn.slot_mapping, latent.to(kv_cache.dtype))
        if batch.mode == ForwardMode.DECODE:
            out = self._absorbed(q_nope, q_pe, kv_cache, batch.attn)
        elif batch.mode == ForwardMode.MIXED:  # decoding rows first (absorbed), then the prefill chunks (MHA)
            rows = batch.num_decode_tokens
            decoding, chunks = batch.parts
            out = torch.cat([self._absorbed(q_nope[:rows], q_pe[:rows], kv_cache, decoding),
                             self._mha(q_nope[rows:], q_pe[rows:], latent[rows:], kv_cache, chunks)])
        else:
            out = self._mha(q_nope, q_pe, latent, kv_cache, batch.attn)
        out = out.reshape(num_tokens, self.num_local_heads * self.v_dim)
        if self.output_gate:
            out = out * torch.sigmoid(self.g_proj(x))
        return self.o_proj(out)

    def _mha(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, kv_cache: torch.Tensor,
        attn: AttentionMetadata,
    ) -> torch.Tensor:
        """EXTEND: q [T, H, nope+rope] against the decompressed context -> [T, H, v]."""
        if attn.is_fresh_prefill:
            context, cu_seqlens_k = latent, attn.cu_seqlens_q
        else:
            context = kv_cache.view(-1, kv_cache.shape[-1]).index_select(0, context_slots(attn)).to(latent.dtype)
            cu_seqlens_k = torch.zeros(attn.num_seqs + 1, dtype=torch.int32, device=attn.kv_lens.device)
            cu_seqlens_k[1:] = torch.cumsum(attn.kv_lens, 0)
        num_context = context.shape[0]
        c_kv, k_pe = context.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(c_kv).view(num_context, self.num_local_heads, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_pe.unsqueeze(1).expand(-1, self.num_local_heads, -1)], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1)
        spans = VarlenSpans(attn.cu_seqlens_q, cu_seqlens_k, attn.q_lens_cpu, attn.kv_lens_cpu)
        return self.attention.prefill(q, k, v.contiguous(), spans, self.softmax_scale)

    def _absorbed(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, attn: AttentionMetadata
    ) -> torch.Tensor:
        """DECODE: q_nope W_UK -> [T, H, kv_lora_rank], attention over the latent cache, then W_UV -> [T, H, v]."""
        if self.w_uk.numel() == 0:
            raise RuntimeError("absorbed weights missing: call process_weights_after_loading() after loading")
        q_latent = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)  # [T, H, kv_lora_rank]
        q = torch.cat([q_latent, q_pe], dim=-1)
        out_latent = self.attention.decode(q, kv_cache, attn, self.softmax_scale, self.kv_lora_rank)
        return torch.bmm(out_latent.transpose(0, 1), self.w_uv_t).transpose(0, 1)  # [T, H, v]
