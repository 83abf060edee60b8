"""The routed experts in plain torch: three interchangeable ways to compute the same sum.

Every function takes this rank's stacked experts and the router's choice and returns
    out[t] = sum over slots s with 0 <= local_ids[t, s] < E of weights[t, s] * expert_{local_ids[t, s]}(x[t])
where expert_e(x) = down[e] @ (silu(gate) * up), [gate; up] = gate_up[e] @ x. Slots whose expert lives
on another rank (local id outside [0, E)) contribute nothing.

Shapes: x [T, H]; gate_up [E, 2I, H]; down [E, H, I]; weights [T, k] float32; local_ids [T, k] int64
(expert id minus this rank's first expert) -> [T, H] float32.

- moe_loop: one pass per expert over a boolean mask (transformers' style); the test oracle.
- moe_grouped: assignments sorted by expert, one matmul per ACTIVE expert over all its tokens.
- moe_dense: every expert on every token in two batched matmuls, unrouted pairs weighted zero;
  cheaper only when dispatch overhead outweighs the wasted FLOPs (see use_dense_moe).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

# The dense path's extra cost over the grouped one is work proportional to experts * weights-per-expert *
# (tokens + 1) (the unrouted multiply-adds plus reading every expert's weights, where grouped reads only the
# active ones); its saving is the grouped path's fixed dispatch cost (sort, gather, a few small ops per
# active expert). So dense pays only while experts * 3 * hidden * intermediate * (tokens + 1) is small.
# Measured on CPU (benchmarks/bench_moe.py; BENCHMARKS.md "MoE paths"), this bound separates the two.
DENSE_MAX_WORK = 2**24


def use_dense_moe(num_tokens: int, num_experts: int, hidden: int, intermediate: int) -> bool:
    """Whether moe_dense is the cheaper CPU path for this step (see DENSE_MAX_WORK)."""
    return num_experts * 3 * hidden * intermediate * (num_tokens + 1) <= DENSE_MAX_WORK


def _expert(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """x [n, H], gate_up [2I, H], down [H, I] -> [n, H] float32."""
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down).float()


def moe_loop(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
             local_ids: torch.Tensor) -> torch.Tensor:
    """The straightforward per-expert loop (every expert checked, a host sync each): the reference."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for expert in range(gate_up.shape[0]):
        tokens, slots = (local_ids == expert).nonzero(as_tuple=True)
        if tokens.numel():
            result = _expert(x[tokens], gate_up[expert], down[expert]) * weights[tokens, slots, None]
            out.index_add_(0, tokens, result)
    return out


def moe_grouped(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                local_ids: torch.Tensor) -> torch.Tensor:
    """Only the selected experts: (token, slot) pairs sorted by expert, one matmul pair per active expert."""
    num_tokens, top_k = local_ids.shape
    num_experts = gate_up.shape[0]
    flat_ids = local_ids.reshape(-1)
    assignments = ((flat_ids >= 0) & (flat_ids < num_experts)).nonzero().squeeze(1)
    if assignments.numel() == 0:
        return torch.zeros(num_tokens, x.shape[1], dtype=torch.float32, device=x.device)
    assignments = assignments[torch.argsort(flat_ids[assignments], stable=True)]  # grouped by expert
    counts = torch.bincount(flat_ids[assignments], minlength=num_experts).tolist()
    inputs = x.index_select(0, assignments // top_k)
    results = torch.empty(inputs.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    offset = 0
    for expert, count in enumerate(counts):
        if count:
            end = offset + count
            results[offset:end] = _expert(inputs[offset:end], gate_up[expert], down[expert])
            offset = end
    results.mul_(weights.reshape(-1).index_select(0, assignments).unsqueeze(1))
    # Back to (token, slot) order; slots routed to other ranks stay zero (index_copy_ + sum: CPU
    # index_add_ is far slower here).
    per_slot = torch.zeros(num_tokens * top_k, x.shape[1], dtype=torch.float32, device=x.device)
    per_slot.index_copy_(0, assignments, results)
    return per_slot.view(num_tokens, top_k, -1).sum(dim=1)


def routing_matrix(weights: torch.Tensor, local_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[T, k] weights and local ids -> [T, E] float32 combine weights (zero where not routed locally)."""
    routed = (local_ids >= 0) & (local_ids < num_experts)
    combine = torch.zeros(local_ids.shape[0], num_experts, dtype=torch.float32, device=local_ids.device)
    return combine.scatter_add_(1, local_ids.clamp(0, num_experts - 1), torch.where(routed, weights, 0.0))


def moe_dense(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
              local_ids: torch.Tensor) -> torch.Tensor:
    """Every local expert on every token (two batched matmuls), combined with the routing weights."""
    num_tokens = x.shape[0]
    num_experts, two_inter, hidden = gate_up.shape
    combine = routing_matrix(weights, local_ids, num_experts)
    gate_up_out = F.linear(x, gate_up.reshape(-1, hidden)).view(num_tokens, num_experts, two_inter)
    gate, up = gate_up_out.chunk(2, dim=-1)
    activated = (F.silu(gate) * up).transpose(0, 1)  # [E, T, I]
    out = torch.bmm(activated, down.transpose(1, 2)).float()  # [E, T, H]
    return torch.bmm(combine.unsqueeze(1), out.transpose(0, 1)).squeeze(1)
