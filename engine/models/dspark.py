"""DSpark draft (K3_SPEC 5.2-5.3): the DFlash block-parallel backbone + a Markov head (+ a confidence head).

Backbone: ctx = hidden_norm(fc(concat target taps)); each layer's context K/V come from ctx (k/v proj,
per-head k RMSNorm, RoPE at the token's position); the block [bonus, MASK x (n-1)] attends non-causally
to the request's context and the whole block; final norm; the TARGET's embedding and LM head. This is
DFlashDraft's computation (reused), with the published names, YaRN RoPE when configured, and the
"DeepSpec" slot convention: slot k predicts position L+k+1 (shifted_block). Layers are Qwen3-style
(q/k/v/o, q_norm / k_norm), or K3 MLA in the KimiK3DSparkMLADraftModel variant (engine/models/dspark_mla.py).

Markov head (engine/models/dspark_markov.py: vanilla, gated or rnn): drafts are formed left to right,
logits_k = base_k + bias_k(prev_k[, h_k]), prev_0 = bonus, prev_{k+1} = the draft chosen at k (greedy
argmax or sampled), so verification against these Markov-corrected probabilities is exact.
Confidence head (optional): c_k = sigmoid(w . [h_k ; E1[prev_k]] + b), float32 (not used to shorten
verification here: every draft is verified).

Published tensor names <-> module names: layers.{i}.self_attn.{q,k,v,o}_proj / {q,k}_norm (MLA:
q_a_proj, q_a_layernorm, q_b_proj (or q_proj), kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj),
layers.{i}.mlp.{gate,up,down}_proj, layers.{i}.{input,post_attention}_layernorm, fc, hidden_norm, norm,
markov_head.markov_w1 (embedding) / markov_w2 (linear) (+ gate_proj or joint_proj), confidence_head.proj.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from engine.layers.rotary import rope_inv_freq
from engine.models.dflash import DFlashDraft
from engine.models.dspark_config import DSparkConfig, read_dspark_config
from engine.models.dspark_markov import ConfidenceHead, build_markov_head
from engine.models.dspark_mla import DSparkMLALayer

SKIPPED_PREFIXES = ("embed_tokens.", "lm_head.", "rotary_emb.")
_RENAMES = (
    (r"^layers\.(\d+)\.self_attn\.", r"layers.\1."),
    (r"^layers\.(\d+)\.mlp\.", r"layers.\1."),
    (r"^layers\.(\d+)\.input_layernorm\.", r"layers.\1.input_norm."),
    (r"^layers\.(\d+)\.post_attention_layernorm\.", r"layers.\1.post_attention_norm."),
    (r"^hidden_norm\.", "context_norm."),
)
_MODULE_TO_PUBLISHED = (
    (r"^layers\.(\d+)\.([qkvo]_proj|[qk]_norm|q_a_proj|q_a_layernorm|q_b_proj|kv_a_proj_with_mqa|kv_a_layernorm|"
     r"kv_b_proj)\.", r"layers.\1.self_attn.\2."),
    (r"^layers\.(\d+)\.(gate_proj|up_proj|down_proj)\.", r"layers.\1.mlp.\2."),
    (r"^layers\.(\d+)\.input_norm\.", r"layers.\1.input_layernorm."),
    (r"^layers\.(\d+)\.post_attention_norm\.", r"layers.\1.post_attention_layernorm."),
    (r"^context_norm\.", "hidden_norm."),
)


def _rename(name: str, rules) -> str:
    for pattern, replacement in rules:
        name, count = re.subn(pattern, replacement, name)
        if count:
            break
    return name


class DSparkDraft(DFlashDraft):
    """The DSpark network; the target's embedding and LM head are applied outside (engine/runtime/model_runner.py)."""

    shifted_block = True  # slot k predicts position L+k+1

    def __init__(self, config: DSparkConfig, confidence: bool | None = None) -> None:
        b = config.backbone
        make_layer = None
        if config.mla is not None:  # the MLA-layer variant (engine/models/dspark_mla.py)
            make_layer = lambda: DSparkMLALayer(b.hidden_size, b.intermediate_size, b.rms_norm_eps,  # noqa: E731
                                                config.mla, config.rope)
        super().__init__(b, make_layer)
        self.config = config  # type: ignore[assignment]  (a DSparkConfig: same fields the engine reads)
        self.register_buffer("inv_freq", rope_inv_freq(config.rope, b.head_dim), persistent=False)
        self.rope_scale = config.rope.cos_sin_scale
        self.markov_head = build_markov_head(config.markov_kind, config.vocab_size, config.markov_rank, b.hidden_size)
        use_confidence = config.use_confidence_head if confidence is None else confidence
        self.confidence_head = ConfidenceHead(config.hidden_size, config.markov_rank) if use_confidence else None

    def _rope(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        angles = positions.to(torch.float32).unsqueeze(-1) * self.inv_freq.float()
        angles = torch.cat((angles, angles), dim=-1)
        return (angles.cos() * self.rope_scale).to(dtype), (angles.sin() * self.rope_scale).to(dtype)

    def confidence(self, hidden: Tensor, prev: Tensor) -> Tensor:
        """hidden: [n, hidden] (final-normed), prev: [n] -> [n] acceptance confidence in (0, 1)."""
        if self.confidence_head is None:
            raise ValueError("this DSpark draft has no confidence head")
        features = torch.cat((hidden.float(), self.markov_head.markov_w1(prev).float()), dim=-1)
        return torch.sigmoid(self.confidence_head.proj(features).squeeze(-1))

    def published_state_dict(self) -> dict[str, Tensor]:
        return {_rename(name, _MODULE_TO_PUBLISHED): t for name, t in self.state_dict().items()}


def save_dspark(draft: DSparkDraft, draft_dir: str | Path, dtype: torch.dtype = torch.bfloat16) -> None:
    """config.json + model.safetensors in the published layout (confidence head kept in float32)."""
    import json

    path = Path(draft_dir)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(draft.config.to_dict(), indent=2) + "\n")
    tensors = {name: t.detach().to(torch.float32 if name.startswith("confidence_head.") else dtype).contiguous()
               for name, t in draft.published_state_dict().items()}
    save_file(tensors, str(path / "model.safetensors"))


def _read_tensors(path: Path) -> dict[str, Tensor]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"DSpark draft {path} has no *.safetensors file")
    tensors: dict[str, Tensor] = {}
    for file in files:
        for name, tensor in load_file(str(file)).items():
            name = name.removeprefix("model.")
            if not name.startswith(SKIPPED_PREFIXES):
                tensors[_rename(name, _RENAMES)] = tensor
    return tensors


def load_dspark(draft_dir: str | Path, dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu") -> DSparkDraft:
    """Loads a published-layout DSpark draft; one ValueError naming every missing / unexpected / mis-shaped tensor."""
    path = Path(draft_dir)
    config = read_dspark_config(path)
    tensors = _read_tensors(path)
    confidence = config.use_confidence_head
    if confidence is None:
        confidence = "confidence_head.proj.weight" in tensors
    draft = build_dspark(config, dtype, device, confidence)
    expected = draft.state_dict()
    missing = sorted(_rename(n, _MODULE_TO_PUBLISHED) for n in set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    shapes = sorted(f"{_rename(n, _MODULE_TO_PUBLISHED)} {tuple(tensors[n].shape)} != {tuple(expected[n].shape)}"
                    for n in set(expected) & set(tensors) if tensors[n].shape != expected[n].shape)
    if missing or unexpected or shapes:
        raise ValueError(f"DSpark draft {path}: missing tensors {missing}, unexpected {unexpected}, wrong shapes {shapes}")
    draft.load_state_dict(tensors)
    return draft.eval()


def build_dspark(config: DSparkConfig, dtype: torch.dtype, device: torch.device | str = "cpu",
                 confidence: bool | None = None) -> DSparkDraft:
    """An uninitialised-weights draft built in `dtype` on `device` (the confidence head stays float32)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            draft = DSparkDraft(config, confidence)
    finally:
        torch.set_default_dtype(previous)
    if draft.confidence_head is not None:
        draft.confidence_head.float()
    return draft
