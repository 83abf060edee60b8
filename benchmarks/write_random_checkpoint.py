"""Writes a random DeepSeek-V3-shaped checkpoint (HF layout: config.json from transformers'
DeepseekV3Config + model.safetensors) for GPU benchmarks. Default: ~1.2B parameters - hidden 2048,
16 layers, 32 heads, 64 routed experts top-6 (moe_intermediate 128), 1 shared expert, first layer dense.
--tiny writes a few-MB model of the same family (for the CPU dry run of scripts/gpu_check.py); --shape 85m the
~88M-parameter CPU benchmark model of issue 18 (hidden 1024, 4 layers, all MoE, 24 heads, q_lora 256, kv_lora 128,
8 routed experts top-2 with intermediate 512 + 1 shared, vocab 4096; use --dtype float32).

    python benchmarks/write_random_checkpoint.py OUT_DIR [--shape 1b|85m|tiny] [--tiny] [--dtype bfloat16] [--seed 0]
"""
from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch
from safetensors.torch import save_file

logger = logging.getLogger("write_random_checkpoint")

ONE_B = dict(
    vocab_size=32000, hidden_size=2048, intermediate_size=5632, moe_intermediate_size=128, num_hidden_layers=16,
    num_attention_heads=32, q_lora_rank=768, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128, n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=1, n_group=8, topk_group=4,
    first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True, max_position_embeddings=4096,
)
TINY = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
    v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1,
    first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True, max_position_embeddings=1024,
)
M85 = dict(
    vocab_size=4096, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512, num_hidden_layers=4,
    num_attention_heads=24, q_lora_rank=256, kv_lora_rank=128, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
    first_k_dense_replace=0, routed_scaling_factor=2.5, norm_topk_prob=True, max_position_embeddings=4096,
)
SHAPES = {"1b": ONE_B, "85m": M85, "tiny": TINY}
COMMON = dict(rms_norm_eps=1e-6, tie_word_embeddings=False, rope_interleave=True, bos_token_id=0, eos_token_id=1,
              rope_theta=10000.0)


def config_dict(shape: dict) -> dict:
    """The full HF config.json of a shape (transformers fills every field it reads)."""
    from transformers import DeepseekV3Config

    kwargs = {**shape, **COMMON}
    kwargs["num_key_value_heads"] = kwargs["num_attention_heads"]
    return DeepseekV3Config(**kwargs).to_dict()


def random_tensor(name: str, shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """Norm weights 1, router bias small, everything else N(0, 0.02) (fp32 router weights as HF keeps them)."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=dtype)
    if name.endswith("e_score_correction_bias"):
        return (torch.randn(shape, generator=generator) * 0.01).float()
    std = 0.02 if len(shape) > 1 else 0.01
    tensor = torch.randn(shape, generator=generator) * std
    return tensor.float() if name.endswith("mlp.gate.weight") else tensor.to(dtype)


def write_checkpoint(out_dir: Path, shape: dict, dtype: torch.dtype, seed: int) -> int:
    """Writes config.json + model.safetensors; returns the parameter count."""
    from engine.model_configs.model_config import ModelConfig
    from engine.weights.checkpoint import expected_weight_shapes

    out_dir.mkdir(parents=True, exist_ok=True)
    config = config_dict(shape)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    model_config = ModelConfig.from_pretrained(out_dir)
    generator = torch.Generator().manual_seed(seed)
    tensors = {name: random_tensor(name, shape, dtype, generator)
               for name, shape in sorted(expected_weight_shapes(model_config).items())}
    save_file(tensors, str(out_dir / "model.safetensors"))
    count = sum(t.numel() for t in tensors.values())
    logger.info("wrote %s: %.3fB parameters", out_dir, count / 1e9)
    return count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--shape", default="1b", choices=sorted(SHAPES), help="model shape (default: 1b)")
    parser.add_argument("--tiny", action="store_true", help="a few-MB model of the same family (= --shape tiny)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    write_checkpoint(args.out_dir, TINY if args.tiny else SHAPES[args.shape], getattr(torch, args.dtype), args.seed)


if __name__ == "__main__":
    main()
