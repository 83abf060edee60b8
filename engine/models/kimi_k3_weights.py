"""Kimi K3 checkpoint names: on-disk name -> engine name, and every tensor a checkpoint must hold.

On disk (K3_SPEC section 2): language_model.model.* (also spelled language_model.layers.*),
language_model.lm_head.weight, block_sparse_moe.* for MoE layers, routed experts as compressed-tensors
MXFP4 experts.N.{w1,w2,w3}.weight_packed / weight_scale (uint8) - or, without quantization_config,
unquantised experts.N.{w1,w2,w3}.weight in any float dtype - and a vision tower the text engine
ignores. Engine names drop the language_model. prefix and say mlp for block_sparse_moe.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from engine.model_configs.kimi_linear import KimiLinearConfig
from engine.layers.mxfp4 import GROUP_SIZE

IGNORED_PREFIXES = ("vision_tower.", "mm_projector.", "multi_modal_projector.")


def engine_name(disk_name: str) -> str | None:
    """The engine's name for an on-disk tensor name; None for tensors the text model ignores."""
    if disk_name.startswith(IGNORED_PREFIXES):
        return None
    name = disk_name
    if name.startswith("language_model.layers."):
        name = "language_model.model." + name[len("language_model."):]
    if name.startswith("language_model."):
        name = name[len("language_model."):]
    return name.replace(".block_sparse_moe.", ".mlp.")


def _mxfp4(prefix: str, out: int, inp: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    return {prefix + ".weight_packed": ((out, inp // 2), torch.uint8),
            prefix + ".weight_scale": ((out, inp // GROUP_SIZE), torch.uint8)}


def _mla_shapes(c: KimiLinearConfig) -> dict[str, tuple[int, ...]]:
    heads = c.num_attention_heads
    shapes: dict[str, tuple[int, ...]] = {}
    if c.q_lora_rank is None:
        shapes["q_proj.weight"] = (heads * c.qk_head_dim, c.hidden_size)
    else:
        shapes["q_a_proj.weight"] = (c.q_lora_rank, c.hidden_size)
        shapes["q_a_layernorm.weight"] = (c.q_lora_rank,)
        shapes["q_b_proj.weight"] = (heads * c.qk_head_dim, c.q_lora_rank)
    shapes["kv_a_proj_with_mqa.weight"] = (c.kv_cache_dim, c.hidden_size)
    shapes["kv_a_layernorm.weight"] = (c.kv_lora_rank,)
    shapes["kv_b_proj.weight"] = (heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank)
    if c.mla_use_output_gate:
        shapes["g_proj.weight"] = (heads * c.v_head_dim, c.hidden_size)
    shapes["o_proj.weight"] = (c.hidden_size, heads * c.v_head_dim)
    return shapes


def _mlp_shapes(prefix: str, hidden: int, inter: int) -> dict[str, tuple[int, ...]]:
    return {prefix + "gate_proj.weight": (inter, hidden), prefix + "up_proj.weight": (inter, hidden),
            prefix + "down_proj.weight": (hidden, inter)}


def expected_k3_tensors(
    c: KimiLinearConfig, kda_shapes: Callable[[int], dict[str, tuple[int, ...]]],
) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
    """Engine name -> (full shape, required dtype or None for any float) of every tensor of a K3 checkpoint.
    kda_shapes(layer) gives a KDA layer's own tensors (names relative to self_attn.)."""
    hidden = c.hidden_size
    out: dict[str, tuple[tuple[int, ...], torch.dtype | None]] = {}

    def add(shapes: dict[str, tuple[int, ...]], prefix: str = "") -> None:
        out.update({prefix + name: (shape, None) for name, shape in shapes.items()})

    add({"model.embed_tokens.weight": (c.vocab_size, hidden), "model.norm.weight": (hidden,),
         "model.output_attn_res_norm.weight": (hidden,), "model.output_attn_res_proj.weight": (1, hidden)})
    if not c.tie_word_embeddings:
        add({"lm_head.weight": (c.vocab_size, hidden)})
    for layer in range(c.num_hidden_layers):
        p = f"model.layers.{layer}."
        add({name + ".weight": (hidden,) for name in
             ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm", "mlp_res_norm")}, p)
        add({"self_attention_res_proj.weight": (1, hidden), "mlp_res_proj.weight": (1, hidden)}, p)
        add(kda_shapes(layer) if c.is_kda_layer(layer) else _mla_shapes(c), p + "self_attn.")
        m = p + "mlp."
        if not c.is_moe_layer(layer):
            add(_mlp_shapes(m, hidden, c.intermediate_size))
            continue
        latent, inter = c.routed_expert_hidden_size, c.moe_intermediate_size
        add({"gate.weight": (c.num_experts, hidden), "gate.e_score_correction_bias": (c.num_experts,),
             "routed_expert_down_proj.weight": (latent, hidden), "routed_expert_up_proj.weight": (hidden, latent)}, m)
        if c.latent_moe_use_norm:
            add({"routed_expert_norm.weight": (latent,)}, m)
        if c.num_shared_experts:
            add(_mlp_shapes(m + "shared_experts.", hidden, c.shared_intermediate_size))
        for expert in range(c.num_experts):
            e = f"{m}experts.{expert}."
            for name, rows, cols in (("w1", inter, latent), ("w3", inter, latent), ("w2", latent, inter)):
                if c.quantization is not None:
                    out.update(_mxfp4(e + name, rows, cols))
                else:
                    out[e + name + ".weight"] = ((rows, cols), None)
    return out
