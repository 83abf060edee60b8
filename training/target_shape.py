"""The DeepSeek-V3-architecture default model's geometry and the transformers config it is trained and
saved with (the config is the one the engine loads)."""

from __future__ import annotations

from dataclasses import dataclass, fields

from transformers import DeepseekV3Config


@dataclass(frozen=True)
class TargetShape:
    """Model shape. Every width and count divides by 2 (TP=2)."""

    vocab_size: int = 4096  # the byte-level BPE tokenizer's
    hidden_size: int = 192
    intermediate_size: int = 512  # the dense MLP of layer 0
    moe_intermediate_size: int = 128  # each expert's MLP (routed and the one shared)
    num_hidden_layers: int = 3  # layer 0 dense, the others MoE
    num_attention_heads: int = 24  # MLA heads (TP=2: 12 per rank)
    q_lora_rank: int = 96  # MLA query compression
    kv_lora_rank: int = 64  # MLA latent KV width (cached, with the rope part of the key)
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 16
    v_head_dim: int = 16
    n_routed_experts: int = 8  # 2 chosen per token
    train_length: int = 256  # the training window, yarn's original_max_position_embeddings
    max_position_embeddings: int = 16384  # the served context: train_length x the yarn factor

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
                     "num_attention_heads", "n_routed_experts"):
            if getattr(self, name) % 2:
                raise ValueError(f"{name} must be divisible by 2 (TP=2), got {getattr(self, name)}")
        if self.num_hidden_layers < 3:
            raise ValueError(f"num_hidden_layers must be >= 3 (1 dense + 2 MoE), got {self.num_hidden_layers}")
        if self.max_position_embeddings % self.train_length:
            raise ValueError("max_position_embeddings must be a multiple of train_length (yarn factor)")


# every TargetShape field but train_length is the DeepseekV3Config field of the same name
CONFIG_FIELDS = tuple(f.name for f in fields(TargetShape) if f.name != "train_length")


def build_config(shape: TargetShape, bos_id: int, eos_id: int, pad_id: int) -> DeepseekV3Config:
    factor = shape.max_position_embeddings / shape.train_length
    return DeepseekV3Config(
        **{name: getattr(shape, name) for name in CONFIG_FIELDS},
        num_key_value_heads=shape.num_attention_heads,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        norm_topk_prob=True,
        routed_scaling_factor=1.0,
        rope_interleave=True,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": factor,
            "original_max_position_embeddings": shape.train_length,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        tie_word_embeddings=False,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        num_mtp_layers=0,
        initializer_range=0.02,
        experts_implementation="eager",  # not saved; the per-expert loop is the fastest on CPU
    )
