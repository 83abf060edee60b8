"""The one table of tensor-parallel sharding rules, keyed by HF checkpoint weight name.

REPLICATED  every rank holds the whole tensor (q_a_proj, kv_a_proj_with_mqa, norms, router): the MLA
            latent, and so the paged cache, is identical on every rank.
COLUMN      split dim 0 (output features): q_proj / q_b_proj / kv_b_proj by heads, MLP gate/up.
ROW         split dim 1 (input features): o_proj, MLP down (partial sums are all-reduced).
VOCAB       split dim 0 (vocabulary rows): embedding and LM head.
EXPERT      routed experts: rank r owns experts [r*E/tp, (r+1)*E/tp) whole; others skip them.
"""
from __future__ import annotations

import enum
import re
from dataclasses import dataclass

import torch

from engine.runtime.distributed import TPGroup


class ShardKind(enum.Enum):
    REPLICATED = "replicated"
    COLUMN = "column"
    ROW = "row"
    VOCAB = "vocab"
    EXPERT = "expert"


@dataclass(frozen=True)
class ShardRule:
    """Weights whose full name matches `pattern` (re.fullmatch) are split as `kind`."""

    pattern: str
    kind: ShardKind

    def __post_init__(self) -> None:
        re.compile(self.pattern)


_LAYER = r"model\.layers\.\d+\."
SHARDING_RULES: tuple[ShardRule, ...] = (
    ShardRule(r"model\.embed_tokens\.weight", ShardKind.VOCAB),
    ShardRule(r"lm_head\.weight", ShardKind.VOCAB),
    ShardRule(r"model\.norm\.weight", ShardKind.REPLICATED),
    ShardRule(_LAYER + r"(input_layernorm|post_attention_layernorm)\.weight", ShardKind.REPLICATED),
    ShardRule(_LAYER + r"self_attn\.(q_a_proj|kv_a_proj_with_mqa)\.weight", ShardKind.REPLICATED),
    ShardRule(_LAYER + r"self_attn\.(q_a_layernorm|kv_a_layernorm)\.weight", ShardKind.REPLICATED),
    ShardRule(_LAYER + r"self_attn\.(q_proj|q_b_proj|kv_b_proj)\.weight", ShardKind.COLUMN),
    ShardRule(_LAYER + r"self_attn\.o_proj\.weight", ShardKind.ROW),
    # MLA output gate (K3) and Kimi Delta Attention: q|k|v projections and their conv channels, the
    # forget-gate up-projection, dt_bias, beta and output-gate rows split by heads. A_log (one value per
    # head, K3 pads it to 128) is split by the KDA layer itself after dropping the padding.
    ShardRule(_LAYER + r"self_attn\.(k_proj|v_proj|f_b_proj|g_b_proj|g_proj|b_proj)\.weight", ShardKind.COLUMN),
    ShardRule(_LAYER + r"self_attn\.(q_conv1d|k_conv1d|v_conv1d)\.weight", ShardKind.COLUMN),
    ShardRule(_LAYER + r"self_attn\.dt_bias", ShardKind.COLUMN),
    ShardRule(_LAYER + r"self_attn\.(f_a_proj|g_a_proj|o_norm)\.weight", ShardKind.REPLICATED),
    ShardRule(_LAYER + r"self_attn\.A_log", ShardKind.REPLICATED),
    ShardRule(_LAYER + r"mlp\.gate\.(weight|e_score_correction_bias)", ShardKind.REPLICATED),
    ShardRule(_LAYER + r"mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)\.weight", ShardKind.EXPERT),
    ShardRule(_LAYER + r"mlp\.(shared_experts\.)?(gate_proj|up_proj)\.weight", ShardKind.COLUMN),
    ShardRule(_LAYER + r"mlp\.(shared_experts\.)?down_proj\.weight", ShardKind.ROW),
)

_EXPERT_INDEX = re.compile(r"(.*\.mlp\.experts\.)(\d+)(\..*)")


def find_rule(name: str) -> ShardRule:
    """The rule for a weight name; ValueError when none (or more than one) matches."""
    matches = [rule for rule in SHARDING_RULES if re.fullmatch(rule.pattern, name)]
    if len(matches) != 1:
        raise ValueError(f"{len(matches)} sharding rules match weight {name!r}")
    return matches[0]


def _split(tensor: torch.Tensor, dim: int, tp: TPGroup, name: str) -> torch.Tensor:
    if tensor.shape[dim] % tp.size:
        raise ValueError(f"{name}: dim {dim} of size {tensor.shape[dim]} does not split over {tp.size} ranks")
    start, end = tp.shard_range(tensor.shape[dim])
    return tensor.narrow(dim, start, end - start)


def shard_weight(name: str, tensor: torch.Tensor, tp: TPGroup, num_experts: int) -> tuple[str, torch.Tensor] | None:
    """This rank's piece of a full checkpoint tensor, under its local name (experts renumbered from 0),
    or None when the tensor belongs to an expert another rank owns."""
    kind = find_rule(name).kind
    if kind == ShardKind.REPLICATED:
        return name, tensor
    if kind in (ShardKind.COLUMN, ShardKind.VOCAB):
        return name, _split(tensor, 0, tp, name)
    if kind == ShardKind.ROW:
        return name, _split(tensor, 1, tp, name)
    prefix, expert, suffix = _EXPERT_INDEX.fullmatch(name).groups()
    start, end = tp.shard_range(num_experts)
    if not start <= int(expert) < end:
        return None
    return f"{prefix}{int(expert) - start}{suffix}", tensor


def owned_elsewhere(name: str, tp: TPGroup, num_experts: int) -> bool:
    """True for a per-expert weight that another rank owns (this rank need not read it)."""
    match = _EXPERT_INDEX.fullmatch(name)
    if match is None or tp.size == 1:
        return False
    start, end = tp.shard_range(num_experts)
    return not start <= int(match.group(2)) < end
