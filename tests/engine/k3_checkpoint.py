"""Tiny random Kimi K3 checkpoints written in K3's REAL on-disk layout (K3_SPEC sections 1 and 2).

config.json: model_type "kimi_k3", the decoder under text_config (model_type "kimi_linear"),
linear_attn_config with 1-indexed kda_layers / full_attn_layers, a vision_config, and the
compressed-tensors MXFP4 quantization_config. Tensors (float32 here instead of bf16, so that the engine
can be compared at 1e-4): language_model.model.* names, block_sparse_moe, routed experts
experts.N.w1/w2/w3.weight_packed + weight_scale uint8 (MXFP4), A_log stored padded to A_LOG_PADDED
entries (heads first, zeros after), conv weights [P, 1, 4], language_model.lm_head.weight, and a
vision_tower tensor the engine must ignore. Written as two safetensors shards with an index. With
experts="bf16" / "fp32" the routed experts are unquantised experts.N.w1/w2/w3.weight and config.json has no
quantization_config (a dequantised or fine-tuned checkpoint).

Default shapes: hidden 64, 8 layers (MLA at 0-idx 3 and 7), attn_res_block_size 3, 24 KDA / MLA heads
(TP=2 gives 12 per rank), 8 experts top-2, latent 32, expert intermediate 32 (MXFP4 group 32).
"""
from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from engine.layers.mxfp4 import quantize_mxfp4
from pdserve.plan.kimi_k3_config import KIMI_K3_TEXT_CONFIG

A_LOG_PADDED = 32
EXPERT_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}  # unquantised routed-expert layouts
PREFIX = "language_model.model."

# The published K3 decoder config (the planner's preset, pdserve/plan/kimi_k3_config.py) at tiny sizes.
TEXT_CONFIG: dict[str, Any] = {
    **copy.deepcopy(KIMI_K3_TEXT_CONFIG),
    "vocab_size": 320, "hidden_size": 64, "num_hidden_layers": 8, "num_attention_heads": 24, "num_key_value_heads": 24,
    "q_lora_rank": 48, "kv_lora_rank": 32, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8,
    "max_position_embeddings": 4096, "intermediate_size": 96, "num_experts": 8, "num_experts_per_token": 2,
    "moe_intermediate_size": 32, "routed_expert_hidden_size": 32, "routed_scaling_factor": 1.5,
    "attn_res_block_size": 3,
    "linear_attn_config": {"kda_layers": [1, 2, 3, 5, 6, 7], "full_attn_layers": [4, 8], "num_heads": 24,
                           "head_dim": 8, "short_conv_kernel_size": 4, "use_full_rank_gate": True,
                           "gate_lower_bound": -5.0},
}


def k3_config(experts: str = "mxfp4", **text_overrides: Any) -> dict[str, Any]:
    """The whole config.json (top level + text_config with overrides + vision_config). experts: "mxfp4"
    (quantization_config kept), or "bf16" / "fp32": unquantised routed experts, no quantization_config."""
    if experts not in ("mxfp4", *EXPERT_DTYPES):
        raise ValueError(f"experts must be mxfp4 or one of {sorted(EXPERT_DTYPES)}")
    text = copy.deepcopy(TEXT_CONFIG)
    if experts != "mxfp4":
        text.pop("quantization_config")
    for key, value in text_overrides.items():
        if key == "linear_attn_config":
            text[key] = {**text[key], **value}
        else:
            text[key] = value
    return {
        "model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"], "bos_token_id": 1,
        "eos_token_id": 2, "pad_token_id": 319, "media_placeholder_token_id": 318, "tie_word_embeddings": False,
        "text_config": text, "vision_config": {"model_type": "moonvit3d", "hidden_size": 16},
    }


def _is_mla(text: dict[str, Any], layer: int) -> bool:
    return (layer + 1) in text["linear_attn_config"]["full_attn_layers"]


def k3_state_dict(config: dict[str, Any], seed: int = 0, expert_dtype: torch.dtype = torch.float32,
                  ) -> dict[str, torch.Tensor]:
    """Random tensors for every name a K3 checkpoint with this config holds (plus one vision tensor); routed
    experts MXFP4 when the config has a quantization_config, else unquantised in expert_dtype."""
    text = config["text_config"]
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, std: float = 0.15) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    def linear(out: int, inp: int, gain: float = 0.8) -> torch.Tensor:
        """A linear weight [out, in] scaled by fan-in, so activations keep their size layer after layer."""
        return torch.randn(out, inp, generator=gen) * (gain / inp ** 0.5)

    def norm(dim: int) -> torch.Tensor:
        return 1.0 + rand(dim, std=0.1)

    hidden, vocab = text["hidden_size"], text["vocab_size"]
    sd: dict[str, torch.Tensor] = {
        PREFIX + "embed_tokens.weight": rand(vocab, hidden, std=1.0), PREFIX + "norm.weight": norm(hidden),
        PREFIX + "output_attn_res_norm.weight": norm(hidden), PREFIX + "output_attn_res_proj.weight": rand(1, hidden, std=0.15),
        "language_model.lm_head.weight": linear(vocab, hidden, gain=0.5),
        "vision_tower.patch_embed.proj.weight": rand(16, 3, 2, 2),
    }
    lin = text["linear_attn_config"]
    heads, head_dim = lin["num_heads"], lin["head_dim"]
    proj = heads * head_dim
    for layer in range(text["num_hidden_layers"]):
        p = f"{PREFIX}layers.{layer}."
        for name in ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm", "mlp_res_norm"):
            sd[p + name + ".weight"] = norm(hidden)
        for name in ("self_attention_res_proj", "mlp_res_proj"):
            sd[p + name + ".weight"] = rand(1, hidden, std=0.15)
        a = p + "self_attn."
        if _is_mla(text, layer):
            h, qk = text["num_attention_heads"], text["qk_nope_head_dim"] + text["qk_rope_head_dim"]
            sd[a + "q_a_proj.weight"] = linear(text["q_lora_rank"], hidden)
            sd[a + "q_a_layernorm.weight"] = norm(text["q_lora_rank"])
            sd[a + "q_b_proj.weight"] = linear(h * qk, text["q_lora_rank"])
            sd[a + "kv_a_proj_with_mqa.weight"] = linear(text["kv_lora_rank"] + text["qk_rope_head_dim"], hidden)
            sd[a + "kv_a_layernorm.weight"] = norm(text["kv_lora_rank"])
            sd[a + "kv_b_proj.weight"] = linear(h * (text["qk_nope_head_dim"] + text["v_head_dim"]), text["kv_lora_rank"])
            sd[a + "g_proj.weight"] = linear(h * text["v_head_dim"], hidden)
            sd[a + "o_proj.weight"] = linear(hidden, h * text["v_head_dim"], gain=0.4)
        else:
            for name in ("q", "k", "v"):
                sd[a + f"{name}_proj.weight"] = linear(proj, hidden)
                sd[a + f"{name}_conv1d.weight"] = rand(proj, 1, lin["short_conv_kernel_size"], std=0.4)
            sd[a + "f_a_proj.weight"] = linear(head_dim, hidden)
            sd[a + "f_b_proj.weight"] = linear(proj, head_dim)
            sd[a + "dt_bias"] = rand(proj, std=0.5)
            a_log = torch.zeros(max(A_LOG_PADDED, heads))
            a_log[:heads] = rand(heads, std=0.7)
            sd[a + "A_log"] = a_log
            sd[a + "b_proj.weight"] = linear(heads, hidden)
            if lin.get("use_full_rank_gate"):
                sd[a + "g_proj.weight"] = linear(proj, hidden)
            else:
                sd[a + "g_a_proj.weight"] = linear(head_dim, hidden)
                sd[a + "g_b_proj.weight"] = linear(proj, head_dim)
            sd[a + "o_norm.weight"] = norm(head_dim)
            sd[a + "o_proj.weight"] = linear(hidden, proj, gain=0.4)
        m = p + ("mlp." if layer < text["first_k_dense_replace"] else "block_sparse_moe.")
        if layer < text["first_k_dense_replace"]:
            inter = text["intermediate_size"]
            sd[m + "gate_proj.weight"], sd[m + "up_proj.weight"] = linear(inter, hidden), linear(inter, hidden)
            sd[m + "down_proj.weight"] = linear(hidden, inter)
            continue
        experts, latent, inter = text["num_experts"], text["routed_expert_hidden_size"], text["moe_intermediate_size"]
        sd[m + "gate.weight"] = linear(experts, hidden, gain=1.5)
        sd[m + "gate.e_score_correction_bias"] = rand(experts, std=0.05)
        sd[m + "routed_expert_down_proj.weight"] = linear(latent, hidden)
        if text.get("latent_moe_use_norm"):
            sd[m + "routed_expert_norm.weight"] = norm(latent)
        sd[m + "routed_expert_up_proj.weight"] = linear(hidden, latent)
        shared = inter * text["num_shared_experts"]
        sd[m + "shared_experts.gate_proj.weight"] = linear(shared, hidden)
        sd[m + "shared_experts.up_proj.weight"] = linear(shared, hidden)
        sd[m + "shared_experts.down_proj.weight"] = linear(hidden, shared)
        for expert in range(experts):
            for name, shape in (("w1", (inter, latent)), ("w3", (inter, latent)), ("w2", (latent, inter))):
                if "quantization_config" not in text:
                    sd[f"{m}experts.{expert}.{name}.weight"] = linear(*shape).to(expert_dtype)
                    continue
                packed, scale = quantize_mxfp4(linear(*shape))
                sd[f"{m}experts.{expert}.{name}.weight_packed"] = packed
                sd[f"{m}experts.{expert}.{name}.weight_scale"] = scale
    return sd


def write_k3_checkpoint(out: Path, config: dict[str, Any], state_dict: dict[str, torch.Tensor]) -> Path:
    """config.json + two safetensors shards + model.safetensors.index.json under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    names = sorted(state_dict)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2 :]}
    weight_map = {}
    for file, part in shards.items():
        save_file({name: state_dict[name].contiguous() for name in part}, str(out / file))
        weight_map.update({name: file for name in part})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


def make_k3_checkpoint(root: str | Path, name: str = "k3", seed: int = 0, experts: str = "mxfp4",
                       **text_overrides: Any) -> Path:
    """Writes (once) a tiny K3 checkpoint under root/name-seed and returns its directory (experts: k3_config)."""
    out = Path(root) / f"{name}-{seed}"
    if (out / "config.json").exists():
        return out
    config = k3_config(experts, **text_overrides)
    return write_k3_checkpoint(out, config, k3_state_dict(config, seed, EXPERT_DTYPES.get(experts, torch.float32)))
