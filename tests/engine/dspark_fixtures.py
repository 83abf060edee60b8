"""A tiny Kimi K3 checkpoint with a random (deliberately poor) DSpark draft beside it, in the published layout."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from engine.model_configs.model_config import RopeConfig
from engine.models.dflash import DFlashConfig
from engine.models.dspark import DSparkDraft, save_dspark
from engine.models.dspark_config import DSparkConfig, MlaDraftShape
from tests.engine.k3_checkpoint import make_k3_checkpoint

YARN = RopeConfig(rope_type="yarn", theta=10000.0, factor=4.0, original_max_position_embeddings=64)


# The MLA-layer variant's attention at tiny scale (the tiny K3's hidden 64): 4 heads, q through a rank-24 bottleneck, latent 16 + rope 8.
TINY_MLA = MlaDraftShape(hidden_size=64, num_attention_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                         v_head_dim=8)


def dspark_config_for(model_dir: Path, gamma: int = 7, target_layer_ids: tuple[int, ...] = (1, 3, 5),
                      confidence: bool = True, mla: MlaDraftShape | None = None,
                      markov_kind: str = "vanilla") -> DSparkConfig:
    """mla: the MLA-layer variant's attention (None: Qwen3-style layers); markov_kind: vanilla | gated | rnn."""
    text = json.loads((model_dir / "config.json").read_text())["text_config"]
    hidden, vocab = text["hidden_size"], text["vocab_size"]
    backbone = DFlashConfig(
        hidden_size=hidden, num_layers=2, num_heads=mla.num_attention_heads if mla else 4,
        num_kv_heads=mla.num_attention_heads if mla else 2, head_dim=mla.qk_rope_head_dim if mla else 16,
        intermediate_size=2 * hidden, target_layer_ids=target_layer_ids, target_hidden_size=hidden, block_size=gamma,
        mask_token_id=vocab - 1, rms_norm_eps=1e-6,
    )
    return DSparkConfig(backbone=backbone, vocab_size=vocab, markov_rank=8, rope=YARN, use_confidence_head=confidence,
                        markov_kind=markov_kind, mla=mla)


def add_random_dspark(model_dir: Path, gamma: int = 7, seed: int = 0, confidence: bool = True,
                      mla: MlaDraftShape | None = None, markov_kind: str = "vanilla") -> Path:
    """Writes model_dir/draft (a DSpark draft, float32) and returns it."""
    torch.manual_seed(seed)
    draft = DSparkDraft(dspark_config_for(model_dir, gamma, confidence=confidence, mla=mla, markov_kind=markov_kind))
    save_dspark(draft, model_dir / "draft", dtype=torch.float32)
    return model_dir / "draft"


def make_k3_with_dspark(root: Path, gamma: int = 7, seed: int = 0, mla: MlaDraftShape | None = None,
                        markov_kind: str = "vanilla") -> Path:
    """A tiny K3 (written once under root) with a DSpark draft of the given kind in its draft/ folder."""
    suffix = ("_mla" if mla else "") + ("" if markov_kind == "vanilla" else f"_{markov_kind}")
    model_dir = make_k3_checkpoint(root, f"k3_dspark{suffix}", seed=seed)
    add_random_dspark(model_dir, gamma, seed, mla=mla, markov_kind=markov_kind)
    return model_dir


def make_small_vocab_k3_with_dspark(root: Path, vocab_size: int = 16, gamma: int = 3, seed: int = 0,
                                    logit_gain: float = 12.0, markov_gain: float = 4.0) -> Path:
    """A tiny K3 with a `vocab_size`-token vocabulary (so token distributions can be tested exactly) and a random
    DSpark draft. logit_gain sharpens the target's next-token distributions (prompt-dependent, far from uniform);
    markov_gain makes the Markov bias large, so drafts chosen with and without it differ."""
    from tests.engine.k3_checkpoint import k3_config, k3_state_dict, write_k3_checkpoint

    # A smaller K3 than the default (4 layers: 3 KDA + 1 MLA, 4 heads of each kind, 4 experts): the statistical
    # test runs 20k sequences, and per-sequence prefill work scales with the KDA layer count.
    config = k3_config(vocab_size=vocab_size, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                       num_experts=4, linear_attn_config={"kda_layers": [1, 2, 3], "full_attn_layers": [4],
                                                          "num_heads": 4})
    config.update(bos_token_id=0, eos_token_id=1, pad_token_id=vocab_size - 1, media_placeholder_token_id=vocab_size - 2)
    tensors = k3_state_dict(config, seed)
    tensors["language_model.lm_head.weight"] *= logit_gain
    model_dir = write_k3_checkpoint(Path(root) / f"k3_vocab{vocab_size}-{seed}", config, tensors)
    torch.manual_seed(seed)
    draft = DSparkDraft(dspark_config_for(model_dir, gamma, target_layer_ids=(1, 3), confidence=False))
    with torch.no_grad():
        draft.markov_head.markov_w2.weight.mul_(markov_gain)
    save_dspark(draft, model_dir / "draft", dtype=torch.float32)
    return model_dir
