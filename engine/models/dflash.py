"""Block-diffusion (DFlash-style) draft model.

The draft predicts a whole block of B tokens in ONE non-causal forward. Its
context is the target's hidden states at ``target_layer_ids`` (the residual
stream after decoder layer L, i.e. transformers' ``output_hidden_states[L + 1]``),
concatenated, projected and RMS-normalised into a context feature. In every
draft layer the context tokens supply keys/values (that layer's k_proj / v_proj
applied to the context feature; keys RoPE'd at the context token's position).

The block is [last accepted token, MASK x (B-1)], embedded with the TARGET's
embedding, at positions n-1 .. n+B-2 while the context covers 0 .. n-2. Block
tokens see each other and every valid context token. The returned hidden states
go through the TARGET's LM head; block position i (1..B-1) predicts the token
at position n-1+i.

Two entry points compute the same function: ``forward`` (inference: one block
per sequence over a padded context gathered from the engine's cache) and
``forward_anchors`` (training: many blocks per sequence at once, each seeing
only the context before its anchor).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from engine.config_base import check_positive


@dataclass(frozen=True)
class DFlashConfig:
    """Shape of a draft; read from the draft directory's config.json."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    target_layer_ids: tuple[int, ...]
    target_hidden_size: int
    block_size: int
    mask_token_id: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        check_positive(self, ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                              "intermediate_size", "target_hidden_size", "rms_norm_eps", "rope_theta"))
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if not self.target_layer_ids or any(i < 0 for i in self.target_layer_ids):
            raise ValueError(f"target_layer_ids must be non-empty and >= 0, got {self.target_layer_ids}")
        if len(set(self.target_layer_ids)) != len(self.target_layer_ids):
            raise ValueError(f"target_layer_ids must be distinct, got {self.target_layer_ids}")
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block_size}")
        if self.mask_token_id < 0:
            raise ValueError(f"mask_token_id must be >= 0, got {self.mask_token_id}")

    @property
    def draft_dim(self) -> int:
        """Width of one context-cache entry per layer: cat(k, v) over kv heads."""
        return 2 * self.num_kv_heads * self.head_dim

    @property
    def verify_block_size(self) -> int:
        """Largest verify step (last token + drafts) this draft fills: block_size (slot 0 is the last token)."""
        return self.block_size

    @property
    def context_input_size(self) -> int:
        return len(self.target_layer_ids) * self.target_hidden_size

    @classmethod
    def from_dict(cls, data: dict) -> DFlashConfig:
        known = {f.name for f in fields(cls)}
        data = {k: v for k, v in data.items() if k not in ("model_type", "architectures")}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown DFlashConfig fields: {unknown}")
        return cls(**data)

    def to_dict(self) -> dict:
        return {"model_type": "dflash", **asdict(self), "target_layer_ids": list(self.target_layer_ids)}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # one fused op, the same values
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def fused_weight(owner: nn.Module, name: str, linears: tuple[nn.Module, ...]) -> Tensor | None:
    """The linears' (or norms') weights stacked along the output dim, built once and kept on `owner` (rebuilt when one is
    written again), so an inference forward runs them as one matmul; None while autograd records (training
    keeps the separate linears so gradients reach each weight)."""
    if torch.is_grad_enabled() or any(getattr(linear, "bias", None) is not None for linear in linears):
        return None
    sources = tuple(linear.weight for linear in linears)
    key = tuple((id(weight), weight._version) for weight in sources)
    cached = owner.__dict__.get(name)
    if cached is None or cached[0] != key:
        cached = (key, torch.cat(sources, dim=0), sources)  # the sources kept: their ids stay theirs
        owner.__dict__[name] = cached
    return cached[1]


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [..., T, heads, head_dim]; cos/sin: [..., T, head_dim] (half-split rotation)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(-2) + rotated * sin.unsqueeze(-2)


def signed_sin(sin: Tensor) -> Tensor:
    """sin [..., head_dim] -> cat(-sin[first half], sin[second half]): the table apply_rope_signed takes."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def apply_rope_signed(x: Tensor, cos: Tensor, sin_signed: Tensor) -> Tensor:
    """apply_rope(x, cos, sin) with sin_signed = signed_sin(sin), bit-identical (negating a factor of a product
    is exact): one roll instead of two slices, a negation and a cat."""
    return x * cos.unsqueeze(-2) + x.roll(x.shape[-1] // 2, -1) * sin_signed.unsqueeze(-2)


class DFlashLayer(nn.Module):
    """Pre-norm decoder layer whose attention also reads the context entries."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, d
        self.input_norm = RMSNorm(h, config.rms_norm_eps)
        self.q_proj = nn.Linear(h, config.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, config.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, config.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(config.num_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        self.k_norm = RMSNorm(d, config.rms_norm_eps)
        self.post_attention_norm = RMSNorm(h, config.rms_norm_eps)
        self.gate_proj = nn.Linear(h, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, h, bias=False)

    def keys_values(self, x: Tensor, cos: Tensor, sin: Tensor, projected: tuple[Tensor, Tensor] | None = None,
                    ) -> tuple[Tensor, Tensor]:
        """x: [..., T, hidden] -> roped keys, values: [..., T, kv_heads, head_dim]. projected: (k_proj(x),
        v_proj(x)) when the caller already has them."""
        shape = (*x.shape[:-1], self.num_kv_heads, self.head_dim)
        k, v = projected if projected is not None else (self.k_proj(x), self.v_proj(x))
        keys = apply_rope(self.k_norm(k.view(shape)), cos, sin)
        return keys, v.view(shape)

    def _qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q_proj(x), k_proj(x), v_proj(x): one matmul over the stacked weights at inference."""
        weight = fused_weight(self, "_qkv_weight", (self.q_proj, self.k_proj, self.v_proj))
        if weight is None:
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)
        kv = self.num_kv_heads * self.head_dim
        return F.linear(x, weight).split([self.num_heads * self.head_dim, kv, kv], dim=-1)

    def _mlp(self, x: Tensor) -> Tensor:
        """down(silu(gate(x)) * up(x)), gate and up as one matmul at inference."""
        weight = fused_weight(self, "_gate_up_weight", (self.gate_proj, self.up_proj))
        if weight is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate, up = F.linear(x, weight).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)

    def _fused_queries_keys(self, x: Tensor, cos: Tensor, sin: Tensor, sin_is_plain: bool,
                            ) -> tuple[Tensor, Tensor, Tensor] | None:
        """Roped, normed queries and keys and the values, bit-identical to the per-projection path, in a few ops:
        one qkv matmul, ONE rms_norm over the query and key heads together (weighted by the stacked q_norm /
        k_norm weights) and ONE RoPE over both. Inference on float32 only (None otherwise: training keeps the
        separate modules, other dtypes round between the norm and its weight)."""
        if x.dtype != torch.float32 or self.q_norm.weight.dtype != torch.float32:
            return None
        weight = fused_weight(self, "_qkv_weight", (self.q_proj, self.k_proj, self.v_proj))
        scale = fused_weight(self, "_qk_norm_weight", (self.q_norm,) * self.num_heads + (self.k_norm,) * self.num_kv_heads)
        if weight is None or scale is None:
            return None
        normed = self.num_heads + self.num_kv_heads
        rows = F.linear(x, weight).unflatten(-1, (normed + self.num_kv_heads, self.head_dim))
        both = F.rms_norm(rows[..., :normed, :], (self.head_dim,), eps=self.q_norm.eps) * scale.view(normed, self.head_dim)
        both = apply_rope_signed(both, cos, signed_sin(sin) if sin_is_plain else sin)
        queries, keys = both.split([self.num_heads, self.num_kv_heads], dim=-2)
        return queries, keys, rows[..., normed:, :]

    def context_entry(self, feature: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """feature: [..., T, hidden] -> [..., T, draft_dim] = cat(k roped, v)."""
        keys, values = self.keys_values(feature, cos, sin)
        return torch.cat((keys.flatten(-2), values.flatten(-2)), dim=-1)

    def forward(self, hidden: Tensor, cos: Tensor, sin: Tensor, context: Tensor, mask: Tensor | None,
                sin_signed: Tensor | None = None) -> Tensor:
        """hidden: [S, Q, hidden]; context: [S, C, draft_dim]; mask: [S, Q, C + Q] (True = attend) or None (every
        row sees everything). sin_signed: signed_sin(sin) when the caller has it (the inference path uses it)."""
        s, q_len, _ = hidden.shape
        x = self.input_norm(hidden)
        fused = self._fused_queries_keys(x, cos, sin_signed if sin_signed is not None else sin, sin_signed is None)
        if fused is not None:
            queries, keys, values = fused
        else:
            q, k, v = self._qkv(x)
            queries = apply_rope(self.q_norm(q.view(s, q_len, self.num_heads, self.head_dim)), cos, sin)
            keys, values = self.keys_values(x, cos, sin, (k, v))
        half = context.shape[-1] // 2
        heads = (self.num_kv_heads, self.head_dim)
        keys = torch.cat((context[..., :half].unflatten(-1, heads), keys), dim=1)
        values = torch.cat((context[..., half:].unflatten(-1, heads), values), dim=1)
        attended = F.scaled_dot_product_attention(
            queries.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
            attn_mask=None if mask is None else mask.unsqueeze(1), enable_gqa=True,
        )
        hidden = hidden + self.o_proj(attended.transpose(1, 2).reshape(s, q_len, -1))
        return hidden + self._mlp(self.post_attention_norm(hidden))


class DFlashDraft(nn.Module):
    """The draft network; the target's embedding and LM head are applied outside."""

    shifted_block = False  # block slot i predicts position n-1+i (slot 0 is the last token's own)

    def __init__(self, config: DFlashConfig, make_layer=None) -> None:
        """make_layer() -> a layer with DFlashLayer's interface (context_entry, forward); default DFlashLayer."""
        super().__init__()
        self.config = config
        self.fc = nn.Linear(config.context_input_size, config.hidden_size, bias=False)
        self.context_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList((make_layer or (lambda: DFlashLayer(config)))() for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        exponent = torch.arange(0, config.head_dim, 2, dtype=torch.float32) / config.head_dim
        self.register_buffer("inv_freq", 1.0 / config.rope_theta**exponent, persistent=False)

    def _rope(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """positions: [...] -> cos, sin: [..., head_dim]."""
        angles = positions.to(torch.float32).unsqueeze(-1) * self.inv_freq.float()
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def context_entries(self, captured: Tensor, positions: Tensor) -> Tensor:
        """captured: [..., T, len(ids) * target_hidden]; positions: [..., T] -> [num_layers, ..., T, draft_dim]."""
        dtype = self.fc.weight.dtype
        feature = self.context_norm(self.fc(captured.to(dtype)))
        cos, sin = self._rope(positions, dtype)
        fused = self._fused_context_entries(feature, cos, sin)
        if fused is not None:
            return fused
        return torch.stack([layer.context_entry(feature, cos, sin) for layer in self.layers])

    def _fused_context_entries(self, feature: Tensor, cos: Tensor, sin: Tensor) -> Tensor | None:
        """Every DFlashLayer's context_entry at once (inference; None otherwise): the layers' k / v projections
        as one matmul and their key norms and RoPE as one op each, instead of a dozen ops per layer - this
        runs in every verify and prefill forward that stores draft context."""
        layers = list(self.layers)
        if not all(type(layer) is DFlashLayer for layer in layers):
            return None
        projections = fused_weight(self, "_context_kv_weight", tuple(p for layer in layers for p in (layer.k_proj,
                                                                                                      layer.v_proj)))
        norms = fused_weight(self, "_context_norm_weight", tuple(layer.k_norm for layer in layers))
        if projections is None or norms is None:
            return None
        kv_heads, head_dim = layers[0].num_kv_heads, layers[0].head_dim
        rows = F.linear(feature, projections).unflatten(-1, (len(layers), 2, kv_heads, head_dim)).movedim(-4, 0)
        keys, values = rows.unbind(-3)  # [layers, ..., T, kv_heads, head_dim]
        scale = norms.view(len(layers), *(1,) * (keys.dim() - 2), head_dim)
        keys = F.rms_norm(keys.float(), (head_dim,), eps=layers[0].k_norm.eps).to(keys.dtype) * scale
        keys = apply_rope(keys, cos, sin)
        return torch.cat((keys.flatten(-2), values.flatten(-2)), dim=-1)

    def _run(self, hidden: Tensor, positions: Tensor, context: Tensor, mask: Tensor | None) -> Tensor:
        cos, sin = self._rope(positions, hidden.dtype)
        signed = signed_sin(sin)  # once for every DFlashLayer (apply_rope_signed)
        for index, layer in enumerate(self.layers):
            if type(layer) is DFlashLayer:
                hidden = layer(hidden, cos, sin, context[index].to(hidden.dtype), mask, signed)
            else:
                hidden = layer(hidden, cos, sin, context[index].to(hidden.dtype), mask)
        return self.norm(hidden)

    def forward(self, block_embeds: Tensor, block_positions: Tensor, context: Tensor, context_lens: Tensor,
                full_context: bool = False) -> Tensor:
        """block_embeds: [S, B, hidden]; block_positions: [S, B];
        context: [num_layers, S, Lmax, draft_dim] (rows >= context_lens[s] are padding); context_lens: [S]
        -> hidden states [S, B, hidden] (after the final norm). full_context: the caller knows every
        context_lens[s] == Lmax (no padding), so no mask is built."""
        s, b, _ = block_embeds.shape
        lmax = context.shape[2]
        mask = None
        if not full_context:
            valid = torch.arange(lmax, device=context.device)[None, :] < context_lens.to(context.device)[:, None]
            mask = torch.cat((valid[:, None, :].expand(s, b, lmax), valid.new_ones(s, b, b)), dim=-1)
        return self._run(block_embeds.to(self.fc.weight.dtype), block_positions, context, mask)

    def forward_anchors(self, captured: Tensor, block_embeds: Tensor, anchors: Tensor) -> Tensor:
        """Training path: many blocks per sequence in one pass.

        captured: [N, T, len(ids) * target_hidden] (positions 0..T-1); block_embeds: [N, K, B, hidden];
        anchors: [N, K] (block k sits at anchors[k] .. anchors[k]+B-1 and sees context < anchors[k])
        -> [N, K, B, hidden]."""
        n, t, _ = captured.shape
        _, k, b, h = block_embeds.shape
        positions = torch.arange(t, device=captured.device).expand(n, t)
        context = self.context_entries(captured, positions)
        block_positions = (anchors[..., None] + torch.arange(b, device=anchors.device)).reshape(n, k * b)
        sees_context = torch.arange(t, device=anchors.device)[None, None, :] < anchors[..., None]  # [N, K, T]
        sees_context = sees_context[:, :, None, :].expand(n, k, b, t).reshape(n, k * b, t)
        block_id = torch.arange(k, device=anchors.device).repeat_interleave(b)
        same_block = (block_id[:, None] == block_id[None, :]).expand(n, k * b, k * b)
        mask = torch.cat((sees_context, same_block), dim=-1)
        hidden = self._run(block_embeds.reshape(n, k * b, h).to(self.fc.weight.dtype), block_positions, context, mask)
        return hidden.view(n, k, b, h)


def save_draft(draft: DFlashDraft, draft_dir: str | Path, dtype: torch.dtype = torch.bfloat16) -> None:
    """Write config.json and model.safetensors."""
    path = Path(draft_dir)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(draft.config.to_dict(), indent=2) + "\n")
    tensors = {name: t.detach().to(dtype).contiguous() for name, t in draft.state_dict().items()}
    save_file(tensors, str(path / "model.safetensors"))


def read_draft_config(draft_dir: str | Path) -> DFlashConfig:
    return DFlashConfig.from_dict(json.loads((Path(draft_dir) / "config.json").read_text()))


def load_draft(
    draft_dir: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> DFlashDraft:
    """Load a draft directory onto `device`; missing or unexpected tensors raise one ValueError listing them."""
    path = Path(draft_dir)
    config = read_draft_config(path)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in place in `dtype` on `device` (no conversion pass afterwards)
    try:
        with torch.device(device):
            draft = DFlashDraft(config)
    finally:
        torch.set_default_dtype(previous)
    draft.inv_freq = draft.inv_freq.to(dtype)
    tensors = load_file(str(path / "model.safetensors"))
    expected = set(draft.state_dict())
    missing, unexpected = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
    if missing or unexpected:
        raise ValueError(f"draft weights in {path} do not match config: missing {missing}, unexpected {unexpected}")
    draft.load_state_dict(tensors)
    return draft.eval()
