"""LatentMoE (Kimi K3): routed experts computed in a narrower latent space, shared experts at full width.

  weights, ids = route(x)                        (full width, float32: sigmoid, top-k by s + bias,
                                                  weights = unbiased s renormalised, x scaling factor)
  u     = routed_expert_down_proj(x)             [T, latent] (replicated)
  y_lat = sum_e w_e * w2_e(SiTU(w1_e u, w3_e u)) [T, latent] float32, this rank's experts only,
          all-reduced over ranks BEFORE the norm (the norm is not linear)
  y     = routed_expert_up_proj(RMSNorm(y_lat))  [T, hidden] (norm optional: latent_moe_use_norm)
  out   = y + shared(x)                          shared = SiTU MLP at full width (row-parallel, reduced)

Routed experts are MXFP4 (PackedExperts) or, from a checkpoint without quantization_config, plain weights
(DenseExperts, same interface), sharded whole over ranks as engine/layers/moe.py does: rank r owns
experts [r*E/tp, (r+1)*E/tp). Only selected experts run; each runs one matmul pair over all its tokens. On CPU,
small steps (a decode or speculative verify step of a small model: moe_torch.use_dense_moe) run every local
expert densely over the experts' weights decoded once (PackedExperts.dequantized): a few batched ops instead
of a decode + matmul pair per selected expert.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.model_configs.base import check_positive
from engine.runtime.distributed import TPGroup
from engine.kernels.moe_torch import moe_dense, routing_matrix, use_dense_moe
from engine.layers.dense_experts import DenseExperts
from engine.layers.linear import ReplicatedLinear
from engine.layers.moe import select_experts
from engine.layers.mxfp4 import PackedExperts
from engine.layers.norm import RMSNorm
from engine.layers.situ import SiTUMLP, situ_glu, situ_glu_fused


@dataclass(frozen=True)
class LatentMoEShape:
    """The sizes and routing constants of one LatentMoE block."""

    hidden_size: int
    latent_size: int
    intermediate_size: int  # per routed expert
    num_experts: int
    top_k: int
    shared_intermediate_size: int  # 0: no shared experts
    use_norm: bool
    renormalize: bool
    routed_scaling_factor: float
    situ_beta: float
    situ_linear_beta: float
    rms_norm_eps: float
    mxfp4_experts: bool = True  # False: unquantised routed experts (DenseExperts, the model's dtype)

    def __post_init__(self) -> None:
        check_positive(self, ("hidden_size", "latent_size", "intermediate_size", "num_experts", "top_k"),
                       "LatentMoEShape.")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k={self.top_k} exceeds num_experts={self.num_experts}")
        if self.num_experts < 2:
            raise ValueError("noaux_tc routing needs at least 2 experts")


class LatentRouter(nn.Module):
    """gate.weight [E, hidden] and gate.e_score_correction_bias [E], kept in float32 (routing in float32)."""

    def __init__(self, shape: LatentMoEShape) -> None:
        super().__init__()
        self.shape = shape
        self.weight = nn.Parameter(torch.empty(shape.num_experts, shape.hidden_size, dtype=torch.float32), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(shape.num_experts, dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, hidden] -> (weights [T, k] float32, ids [T, k] int64)."""
        s = self.shape
        logits = F.linear(x.float(), self.weight)
        return select_experts(logits, self.e_score_correction_bias, s.top_k, 1, 1, "noaux_tc", "sigmoid",
                              s.renormalize, s.routed_scaling_factor)


def run_packed_experts(
    experts: PackedExperts | DenseExperts, expert_start: int, u: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
    beta: float, linear_beta: float,
) -> torch.Tensor:
    """u [T, latent], weights/ids [T, k] -> [T, latent] float32: sum over the selected experts this rank owns
    (local ids expert_start ..), tokens grouped by expert so each expert runs once over all its tokens."""
    if u.is_cuda:
        return run_packed_experts_on_device(experts, expert_start, u, weights, ids, beta, linear_beta)
    num_tokens, top_k = ids.shape
    local_ids = ids.reshape(-1) - expert_start
    mine = ((local_ids >= 0) & (local_ids < experts.num_experts)).nonzero().squeeze(1)
    out = torch.zeros(num_tokens * top_k, u.shape[1], dtype=torch.float32, device=u.device)
    if mine.numel() == 0:
        return out.view(num_tokens, top_k, -1).sum(dim=1)
    mine = mine[torch.argsort(local_ids[mine], stable=True)]  # flat (token, slot) indices grouped by expert
    counts = torch.bincount(local_ids[mine], minlength=experts.num_experts).tolist()
    inputs = u.index_select(0, mine // top_k)
    results = torch.empty(inputs.shape[0], u.shape[1], dtype=torch.float32, device=u.device)
    offset = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        chunk = inputs[offset : offset + count]
        hidden = situ_glu_fused(experts.gate_up(expert, chunk), beta, linear_beta).to(u.dtype)
        results[offset : offset + count] = experts.down(expert, hidden)
        offset += count
    results.mul_(weights.reshape(-1).index_select(0, mine).unsqueeze(1))
    out.index_copy_(0, mine, results)
    return out.view(num_tokens, top_k, -1).sum(dim=1)


def run_packed_experts_on_device(
    experts: PackedExperts | DenseExperts, expert_start: int, u: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
    beta: float, linear_beta: float,
) -> torch.Tensor:
    """run_packed_experts on a GPU without a host sync and with fixed shapes (CUDA-graph capturable): every
    local expert over every token, weighted by its routing weight (0 where the token did not pick it). No
    nonzero, no .tolist(), no data-dependent branch; the loop's trip count is the (fixed) local expert count.
    It reads every local expert's weights each step, a bandwidth cost at small batches, until a grouped
    MXFP4 expert kernel takes its place."""
    combine = routing_matrix(weights, ids - expert_start, experts.num_experts)  # [T, E] float32
    out = torch.zeros(u.shape[0], u.shape[1], dtype=torch.float32, device=u.device)
    for expert in range(experts.num_experts):
        hidden = situ_glu_fused(experts.gate_up(expert, u), beta, linear_beta).to(u.dtype)
        out.addcmul_(experts.down(expert, hidden), combine[:, expert : expert + 1])
    return out


class LatentMoE(nn.Module):
    """x [T, hidden] -> [T, hidden], identical on every rank. Parameter names follow the checkpoint's
    block_sparse_moe.* (gate, routed_expert_down_proj, routed_expert_norm, routed_expert_up_proj,
    shared_experts, experts)."""

    def __init__(self, shape: LatentMoEShape, tp: TPGroup, dtype: torch.dtype) -> None:
        super().__init__()
        self.shape = shape
        self.tp = tp
        self.expert_start, expert_end = tp.shard_range(shape.num_experts)
        self.gate = LatentRouter(shape)
        self.routed_expert_down_proj = ReplicatedLinear(shape.hidden_size, shape.latent_size, dtype)
        self.routed_expert_norm = RMSNorm(shape.latent_size, shape.rms_norm_eps, dtype) if shape.use_norm else None
        self.routed_expert_up_proj = ReplicatedLinear(shape.latent_size, shape.hidden_size, dtype)
        local_experts = expert_end - self.expert_start
        self.experts: PackedExperts | DenseExperts = (
            PackedExperts(local_experts, shape.latent_size, shape.intermediate_size) if shape.mxfp4_experts
            else DenseExperts(local_experts, shape.latent_size, shape.intermediate_size, dtype))
        if shape.shared_intermediate_size:
            self.shared_experts: SiTUMLP | None = SiTUMLP(
                shape.hidden_size, shape.shared_intermediate_size, tp, dtype, shape.situ_beta, shape.situ_linear_beta,
            )
        else:
            self.shared_experts = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.shape
        weights, ids = self.gate(x)
        u = self.routed_expert_down_proj(x)
        decoded = self.experts.dequantized()
        if decoded is not None and use_dense_moe(x.shape[0], self.experts.num_experts, s.latent_size,
                                                 s.intermediate_size):
            # A small step on CPU: every local expert densely over the decoded weights (two batched matmuls;
            # cheaper than a matmul pair per selected expert while the step is this small).
            latent = moe_dense(u.float(), *decoded, weights, ids - self.expert_start,
                               glu=lambda gate, up: situ_glu(gate, up, s.situ_beta, s.situ_linear_beta))
        else:
            latent = run_packed_experts(self.experts, self.expert_start, u, weights, ids, s.situ_beta,
                                        s.situ_linear_beta)
        latent = self.tp.all_reduce(latent).to(x.dtype)  # the whole routed sum, before the (non-linear) norm
        if self.routed_expert_norm is not None:
            latent = self.routed_expert_norm(latent)
        out = self.routed_expert_up_proj(latent)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
