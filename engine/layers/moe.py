"""Mixture of experts: router (sigmoid + selection-only bias + group-limited top-k), expert-parallel
routed experts, shared experts; the partial sums of all of them meet in ONE all_reduce per layer."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.model_configs.model_config import ModelConfig
from engine.runtime.distributed import TPGroup
from engine.kernels.fp8_quant import dequantize_fp8_block
from engine.kernels.moe_paths import fused_moe_available, moe_function
from engine.kernels.moe_torch import use_dense_moe
from engine.layers.mlp import DenseMLP


def select_experts(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
    top_k: int,
    n_group: int,
    topk_group: int,
    topk_method: str,
    scoring_func: str,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits: [T, E] float32 -> (weights [T, top_k] float32, expert ids [T, top_k] int64).

    noaux_tc (transformers' DeepseekV3TopkRouter): the bias shifts scores for choosing experts only;
    groups are ranked by the sum of their two best biased scores, the best topk_group groups stay
    eligible. greedy: plain top-k of the scores. Weights are the unbiased scores of the chosen
    experts, optionally normalised to sum 1, times routed_scaling_factor."""
    if scoring_func == "sigmoid":
        scores = router_logits.sigmoid()
    else:
        scores = router_logits.softmax(dim=-1)
    if topk_method == "noaux_tc":
        choice = scores if correction_bias is None else scores + correction_bias
        num_tokens, num_experts = choice.shape
        grouped = choice.view(num_tokens, n_group, num_experts // n_group)
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # [T, n_group]
        group_idx = group_scores.topk(topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
        expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(num_tokens, num_experts)
        choice = choice.masked_fill(~expert_mask, float("-inf"))
        ids = choice.topk(top_k, dim=-1, sorted=False)[1]
    elif topk_method == "greedy":
        ids = scores.topk(top_k, dim=-1, sorted=False)[1]
    else:
        raise ValueError(f"unsupported topk_method {topk_method!r}")
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids


class Router(nn.Module):
    """The replicated gate: weight [E, hidden] and e_score_correction_bias [E], both kept in float32."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        experts = config.n_routed_experts
        self.weight = nn.Parameter(torch.empty(experts, config.hidden_size, dtype=torch.float32), requires_grad=False)
        if config.topk_method == "noaux_tc":
            self.e_score_correction_bias = nn.Parameter(torch.zeros(experts, dtype=torch.float32), requires_grad=False)
        else:
            self.e_score_correction_bias = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, hidden] -> (weights [T, k] float32, ids [T, k] int64)."""
        c = self.config
        logits = F.linear(x.float(), self.weight)
        return select_experts(
            logits, self.e_score_correction_bias, c.num_experts_per_tok, c.n_group, c.topk_group,
            c.topk_method, c.scoring_func, c.norm_topk_prob, c.routed_scaling_factor,
        )


class RoutedExperts(nn.Module):
    """This rank's experts [start, start + E/tp) stacked: gate_up_proj [E_local, 2I, hidden], down_proj [E_local, hidden, I].

    Only the selected experts run (engine.kernels.moe_torch): on a GPU the fused Triton grouped GEMM; on CPU
    the grouped torch path (each active expert's tokens in one matmul), or every expert densely where that
    was measured cheaper (tiny steps: see moe_torch.use_dense_moe)."""

    def __init__(self, config: ModelConfig, tp: TPGroup, dtype: torch.dtype) -> None:
        super().__init__()
        self.expert_start, expert_end = tp.shard_range(config.n_routed_experts)
        self.num_local = expert_end - self.expert_start
        inter, hidden = config.moe_intermediate_size, config.hidden_size
        self.intermediate_size = inter
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_local, 2 * inter, hidden, dtype=dtype), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(self.num_local, hidden, inter, dtype=dtype), requires_grad=False)

    def choose_path(self, num_tokens: int, device: torch.device) -> str:
        """"fused" (Triton, GPU), "dense" or "grouped" (torch) for a step of num_tokens tokens. On a GPU
        without compiled Triton (or under FakeTensorMode with the interpreter) the dense path: it is the
        torch path with no device-to-host sync (the grouped one reads the per-expert counts)."""
        if device.type == "cuda":
            return "fused" if fused_moe_available() else "dense"
        hidden = self.gate_up_proj.shape[2]
        return "dense" if use_dense_moe(num_tokens, self.num_local, hidden, self.intermediate_size) else "grouped"

    fp8_block: tuple[int, int] | None = None  # set by keep_fp8

    def keep_fp8(self, block: tuple[int, int]) -> None:
        """Holds the experts as FP8 (e4m3) with block scales gate_up_scale_inv [E, 2I/bn, H/bk] and
        down_scale_inv [E, H/bn, I/bk] (the checkpoint's format) instead of dequantising them."""
        if self.intermediate_size % block[0]:
            raise ValueError(f"FP8 experts: intermediate size {self.intermediate_size} must be a multiple of the "
                             f"{block[0]}-row quantisation block (gate and up halves keep separate scales)")
        device = self.gate_up_proj.device
        for name in ("gate_up_proj", "down_proj"):
            shape = getattr(self, name).shape
            setattr(self, name, nn.Parameter(torch.empty(shape, dtype=torch.float8_e4m3fn, device=device),
                                             requires_grad=False))
            scale_shape = (shape[0], -(-shape[1] // block[0]), -(-shape[2] // block[1]))
            setattr(self, name.replace("_proj", "_scale_inv"), nn.Parameter(
                torch.empty(scale_shape, dtype=torch.float32, device=device), requires_grad=False))
        self.fp8_block = block

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, path: str | None = None) -> torch.Tensor:
        """x: [T, hidden], weights/ids: [T, k] -> [T, hidden] float32, the sum over this rank's experts only.

        path: force "fused", "dense", "grouped" or "loop" (tests, benchmarks); None chooses."""
        path = path or self.choose_path(x.shape[0], x.device)
        local_ids = ids - self.expert_start
        if self.fp8_block is None:
            return moe_function(path)(x, self.gate_up_proj, self.down_proj, weights, local_ids)
        if path == "fused":
            return moe_function(path)(x, self.gate_up_proj, self.down_proj, weights, local_ids,
                                      gate_up_scale=self.gate_up_scale_inv, down_scale=self.down_scale_inv,
                                      quant_block=self.fp8_block)
        gate_up = dequantize_fp8_block(self.gate_up_proj, self.gate_up_scale_inv, self.fp8_block, x.dtype)
        down = dequantize_fp8_block(self.down_proj, self.down_scale_inv, self.fp8_block, x.dtype)
        return moe_function(path)(x, gate_up, down, weights, local_ids)


class MoE(nn.Module):
    """x [T, hidden] -> routed (this rank's experts) + shared (row-parallel partial), one all_reduce."""

    def __init__(self, config: ModelConfig, tp: TPGroup, dtype: torch.dtype) -> None:
        super().__init__()
        self.tp = tp
        self.gate = Router(config)
        self.experts = RoutedExperts(config, tp, dtype)
        if config.n_shared_experts:
            self.shared_experts = DenseMLP(config.hidden_size, config.shared_intermediate_size, tp, dtype, reduce=False)
        else:
            self.shared_experts = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.experts(x, weights, ids).to(x.dtype)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return self.tp.all_reduce(out)
