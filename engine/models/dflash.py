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
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from engine.models.dflash_config import DFlashConfig, read_draft_config
from engine.models.dflash_layer import DFlashLayer, RMSNorm, apply_rope, apply_rope_signed, fused_weight, signed_sin

__all__ = ["DFlashConfig", "DFlashDraft", "DFlashLayer", "RMSNorm", "apply_rope", "apply_rope_signed", "load_draft",
           "read_draft_config", "save_draft"]


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
