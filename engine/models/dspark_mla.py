"""The MLA-layer DSpark draft (K3_SPEC 5.2, SGLang's KimiK3DSparkMLADraftModel): the DSpark skeleton with each
draft layer's attention as Kimi K3 MLA - with RoPE (YaRN when configured, interleaved pairs) on the rope part
and no output gate - instead of the dense Qwen3-style q/k/v/o.

Context: the projected target taps ctx go through kv_a_proj_with_mqa into the draft's context cache as one
latent row per token and layer, [kv_a_layernorm(c_kv) | RoPE(k_pe)] (kv_lora_rank + qk_rope_head_dim wide,
like the target's MLA cache). Block tokens (after input_layernorm) make their own latent rows the same way
and queries through q_a_proj -> q_a_layernorm -> q_b_proj; every block query attends non-causally to the
request's context rows and the whole block, in MHA form: kv_b_proj(c_kv) -> per head [k_nope | v], keys
[k_nope | k_pe]. Softmax scale: qk_head_dim^-1/2 (times the YaRN mscale^2 when mscale_all_dim is set).
The layer keeps DFlashLayer's interface (context_entry / forward with the draft's cos, sin tables), so the
DSpark draft, the engine's context cache and the proposal path are shared.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.model_configs.model_config import RopeConfig, yarn_get_mscale
from engine.models.dflash import RMSNorm, apply_rope
from engine.models.dspark_config import MlaDraftShape


def rotate(x: Tensor, cos: Tensor, sin: Tensor, interleave: bool) -> Tensor:
    """x: [..., rope]; cos/sin: [..., rope] in the draft's half-split table layout (each angle twice).
    Interleaved: pairs (2i, 2i+1) rotate by angle i and come out half-split (as the target engine's RoPE)."""
    if not interleave:
        return apply_rope(x.unsqueeze(-2), cos, sin).squeeze(-2)
    half = x.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def mla_softmax_scale(mla: MlaDraftShape, rope: RopeConfig) -> float:
    scale = mla.softmax_scale
    if rope.rope_type != "default" and rope.mscale_all_dim:
        scale *= yarn_get_mscale(rope.factor, rope.mscale_all_dim) ** 2
    return scale


class DSparkMLALayer(nn.Module):
    """Pre-norm draft layer: K3 MLA attention over [context rows ; block rows] + SiLU-GLU MLP."""

    def __init__(self, hidden: int, intermediate: int, eps: float, mla: MlaDraftShape, rope: RopeConfig) -> None:
        super().__init__()
        self.mla, self.scale = mla, mla_softmax_scale(mla, rope)
        heads = mla.num_attention_heads
        self.input_norm = RMSNorm(hidden, eps)
        if mla.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, heads * mla.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, mla.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, eps)
            self.q_b_proj = nn.Linear(mla.q_lora_rank, heads * mla.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, mla.kv_cache_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, eps)
        self.kv_b_proj = nn.Linear(mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim), bias=False)
        self.o_proj = nn.Linear(heads * mla.v_head_dim, hidden, bias=False)
        self.post_attention_norm = RMSNorm(hidden, eps)
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def context_entry(self, feature: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """feature: [..., T, hidden]; cos/sin [..., T, rope] -> latent rows [..., T, kv_lora_rank + rope]."""
        latent, k_pe = self.kv_a_proj_with_mqa(feature).split([self.mla.kv_lora_rank, self.mla.qk_rope_head_dim], -1)
        return torch.cat((self.kv_a_layernorm(latent), rotate(k_pe, cos, sin, self.mla.rope_interleave)), dim=-1)

    def _queries(self, x: Tensor) -> Tensor:
        if self.mla.q_lora_rank is None:
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def forward(self, hidden: Tensor, cos: Tensor, sin: Tensor, context: Tensor, mask: Tensor | None) -> Tensor:
        """hidden: [S, Q, hidden]; context: [S, C, latent]; mask: [S, Q, C + Q] (True = attend) or None (every
        row sees everything)."""
        m = self.mla
        s, q_len, _ = hidden.shape
        x = self.input_norm(hidden)
        q_nope, q_pe = self._queries(x).view(s, q_len, m.num_attention_heads, m.qk_head_dim).split(
            [m.qk_nope_head_dim, m.qk_rope_head_dim], -1)
        q_pe = rotate(q_pe, cos.unsqueeze(-2), sin.unsqueeze(-2), m.rope_interleave)
        rows = torch.cat((context, self.context_entry(x, cos, sin)), dim=1)  # [S, C + Q, latent]
        latent, k_pe = rows.split([m.kv_lora_rank, m.qk_rope_head_dim], -1)
        k_nope, values = self.kv_b_proj(latent).view(s, rows.shape[1], m.num_attention_heads, -1).split(
            [m.qk_nope_head_dim, m.v_head_dim], -1)
        keys = torch.cat((k_nope, k_pe.unsqueeze(2).expand(-1, -1, m.num_attention_heads, -1)), dim=-1)
        queries = torch.cat((q_nope, q_pe), dim=-1)
        attended = F.scaled_dot_product_attention(
            queries.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
            attn_mask=None if mask is None else mask.unsqueeze(1), scale=self.scale,
        )
        hidden = hidden + self.o_proj(attended.transpose(1, 2).reshape(s, q_len, -1))
        x = self.post_attention_norm(hidden)
        return hidden + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
