"""Train the DeepSeek-V3-architecture target with transformers' DeepseekV3ForCausalLM."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TargetShape:
    """Model shape. Every width and count divides by 2 (TP=2)."""

    vocab_size: int = 4096
    hidden_size: int = 192
    intermediate_size: int = 512
    moe_intermediate_size: int = 128
    num_hidden_layers: int = 3
    num_attention_heads: int = 24
    q_lora_rank: int = 96
    kv_lora_rank: int = 64
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 16
    v_head_dim: int = 16
    n_routed_experts: int = 8
    train_length: int = 256
    max_position_embeddings: int = 16384

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
                     "num_attention_heads", "n_routed_experts"):
            if getattr(self, name) % 2:
                raise ValueError(f"{name} must be divisible by 2 (TP=2), got {getattr(self, name)}")
        if self.num_hidden_layers < 3:
            raise ValueError(f"num_hidden_layers must be >= 3 (1 dense + 2 MoE), got {self.num_hidden_layers}")
        if self.max_position_embeddings % self.train_length:
            raise ValueError("max_position_embeddings must be a multiple of train_length (yarn factor)")


@dataclass(frozen=True)
class TargetTraining:
    steps: int = 2800
    batch_size: int = 8
    lr: float = 4e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 60
    weight_decay: float = 0.05
    bias_update_rate: float = 1e-3  # aux-loss-free load balancing (DeepSeek-V3)
    log_every: int = 100


def build_config(shape: TargetShape, bos_id: int, eos_id: int, pad_id: int) -> DeepseekV3Config:
    factor = shape.max_position_embeddings / shape.train_length
    return DeepseekV3Config(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        moe_intermediate_size=shape.moe_intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_attention_heads,
        n_shared_experts=1,
        n_routed_experts=shape.n_routed_experts,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        norm_topk_prob=True,
        routed_scaling_factor=1.0,
        q_lora_rank=shape.q_lora_rank,
        kv_lora_rank=shape.kv_lora_rank,
        qk_nope_head_dim=shape.qk_nope_head_dim,
        qk_rope_head_dim=shape.qk_rope_head_dim,
        v_head_dim=shape.v_head_dim,
        max_position_embeddings=shape.max_position_embeddings,
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


def sample_windows(stream: torch.Tensor, batch_size: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """Random windows of ``length + 1`` tokens from a 1-D token stream: [batch, length + 1]."""
    starts = torch.randint(0, stream.numel() - length - 1, (batch_size,), generator=generator)
    return torch.stack([stream[s : s + length + 1] for s in starts.tolist()])


def lr_at(step: int, cfg: TargetTraining) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


class ExpertLoadBalancer:
    """Aux-loss-free balancing: nudge each router's e_score_correction_bias towards equal load."""

    def __init__(self, model: DeepseekV3ForCausalLM, rate: float) -> None:
        self.rate = rate
        self.counts: dict[torch.nn.Module, torch.Tensor] = {}
        self.routers = [m for m in model.modules() if type(m).__name__ == "DeepseekV3TopkRouter"]
        for router in self.routers:
            router.register_forward_hook(self._record)

    def _record(self, module: torch.nn.Module, inputs: tuple, output: tuple) -> None:
        if torch.is_grad_enabled():
            indices = output[2]
            self.counts[module] = torch.bincount(indices.flatten(), minlength=module.num_experts).float()

    @torch.no_grad()
    def update(self) -> None:
        for router, load in self.counts.items():
            router.e_score_correction_bias += self.rate * torch.sign(load.mean() - load)
        self.counts.clear()


def evaluate_loss(model: DeepseekV3ForCausalLM, tokens: torch.Tensor, length: int) -> float:
    """Mean next-token cross-entropy (nats) over ``tokens`` [N] in windows of ``length``."""
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, tokens.numel() - 1, length):
            chunk = tokens[start : start + length + 1]
            if chunk.numel() < 2:
                break
            logits = model(chunk[None, :-1], use_cache=False).logits[0]
            total += F.cross_entropy(logits.float(), chunk[1:], reduction="sum").item()
            count += chunk.numel() - 1
    return total / count


def train_target(
    config: DeepseekV3Config, train_stream: torch.Tensor, cfg: TargetTraining, seed: int
) -> DeepseekV3ForCausalLM:
    """Train from scratch on random windows of ``train_stream`` (float32, AdamW, cosine)."""
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(config)
    model.train()
    logger.info("target parameters: %d", sum(p.numel() for p in model.parameters()))
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr, betas=(0.9, 0.95), fused=True,
    )
    balancer = ExpertLoadBalancer(model, cfg.bias_update_rate)
    generator = torch.Generator().manual_seed(seed)
    length = config.rope_parameters["original_max_position_embeddings"]
    started = time.monotonic()
    running = 0.0
    for step in range(cfg.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        batch = sample_windows(train_stream, cfg.batch_size, length, generator)
        logits = model(batch[:, :-1], use_cache=False).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        balancer.update()
        running += loss.item()
        if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
            logger.info("target step %d/%d loss %.4f lr %.2e elapsed %.0fs", step + 1, cfg.steps,
                        running / ((step % cfg.log_every) + 1), lr_at(step, cfg), time.monotonic() - started)
            running = 0.0
    model.eval()
    return model
