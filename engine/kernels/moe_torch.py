"""The routed experts in plain torch: three interchangeable ways to compute the same sum.

Every function takes this rank's stacked experts and the router's choice and returns
    out[t] = sum over slots s with 0 <= local_ids[t, s] < E of weights[t, s] * expert_{local_ids[t, s]}(x[t])
where expert_e(x) = down[e] @ (silu(gate) * up), [gate; up] = gate_up[e] @ x. Slots whose expert lives
on another rank (local id outside [0, E)) contribute nothing.

Shapes: x [T, H]; gate_up [E, 2I, H]; down [E, H, I]; weights [T, k] float32; local_ids [T, k] int64
(expert id minus this rank's first expert) -> [T, H] float32.

- moe_loop: one pass per expert over a boolean mask (transformers' style); the test oracle.
- moe_grouped: assignments sorted by expert, one matmul per ACTIVE expert over all its tokens (or, when every
  expert is active and padding is cheap, all experts padded to one count in two batched matmuls).
- moe_dense: every expert on every token in two batched matmuls, unrouted pairs weighted zero;
  cheaper only when dispatch overhead outweighs the wasted FLOPs (see use_dense_moe).
"""
from __future__ import annotations

from collections.abc import Callable

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
    """Only the selected experts: (token, slot) pairs sorted by expert, then either one padded batched
    matmul pair over all experts (when every local expert has tokens and padding wastes little: see
    use_padded_experts) or one matmul pair per active expert."""
    num_tokens, top_k = local_ids.shape
    num_experts = gate_up.shape[0]
    flat_ids = local_ids.reshape(-1)
    assignments = ((flat_ids >= 0) & (flat_ids < num_experts)).nonzero().squeeze(1)
    if assignments.numel() == 0:
        return torch.zeros(num_tokens, x.shape[1], dtype=torch.float32, device=x.device)
    assignments = assignments[torch.argsort(flat_ids[assignments], stable=True)]  # grouped by expert
    sorted_ids = flat_ids[assignments]
    counts_tensor = torch.bincount(sorted_ids, minlength=num_experts)
    counts = counts_tensor.tolist()
    if use_padded_experts(counts):
        return _padded_experts(x, gate_up, down, weights, assignments, sorted_ids, counts_tensor, max(counts))
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


# Padded rows per expert below which a row costs about nothing (the matmul streams the expert's weights
# either way), and the padding waste allowed above it.
PADDED_FREE_ROWS = 16
PADDED_MAX_WASTE = 2.0


def use_padded_experts(counts: list[int]) -> bool:
    """Whether one padded batched matmul pair over all experts (each padded to the busiest one's count)
    beats a matmul pair per expert: only when every expert has tokens (the padded path reads every
    expert's weights) and the padding is cheap (few rows, or at most PADDED_MAX_WASTE x the real rows)."""
    busiest = max(counts)
    if min(counts) == 0:
        return False
    return busiest <= PADDED_FREE_ROWS or len(counts) * busiest <= PADDED_MAX_WASTE * sum(counts)


def _padded_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                    assignments: torch.Tensor, sorted_ids: torch.Tensor, counts: torch.Tensor,
                    capacity: int) -> torch.Tensor:
    """Every expert's rows padded to `capacity` and run as two batched matmuls.
    assignments [n] (flat token * k + slot, grouped by expert), sorted_ids [n] their experts, counts [E]
    -> [T, H] float32. Padding rows read a zero input row and are dropped."""
    num_tokens, top_k = weights.shape
    num_experts, hidden = gate_up.shape[0], x.shape[1]
    pad_slot = num_tokens * top_k
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(assignments.numel(), device=x.device) - starts.index_select(0, sorted_ids)
    table = torch.full((num_experts, capacity), pad_slot, dtype=torch.int64, device=x.device)
    table[sorted_ids, rank] = assignments  # [E, C] flat (token, slot) per padded row
    flat_table = table.view(-1)
    padded_x = torch.cat([x, x.new_zeros(1, hidden)])
    inputs = padded_x.index_select(0, torch.clamp(flat_table // top_k, max=num_tokens)).view(num_experts, capacity, hidden)
    gate, up = torch.bmm(inputs, gate_up.transpose(1, 2)).chunk(2, dim=-1)
    out = torch.bmm(F.silu(gate) * up, down.transpose(1, 2)).float().view(-1, hidden)
    row_weights = torch.cat([weights.reshape(-1).float(), weights.new_zeros(1, dtype=torch.float32)])
    out.mul_(row_weights.index_select(0, flat_table).unsqueeze(1))
    per_slot = torch.zeros(pad_slot + 1, hidden, dtype=torch.float32, device=x.device)
    per_slot.index_copy_(0, flat_table, out)  # every padding row lands on the spare row, dropped below
    return per_slot[:pad_slot].view(num_tokens, top_k, hidden).sum(dim=1)


def routing_matrix(weights: torch.Tensor, local_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[T, k] weights and local ids -> [T, E] float32 combine weights (zero where not routed locally)."""
    routed = (local_ids >= 0) & (local_ids < num_experts)
    combine = torch.zeros(local_ids.shape[0], num_experts, dtype=torch.float32, device=local_ids.device)
    return combine.scatter_add_(1, local_ids.clamp(0, num_experts - 1), torch.where(routed, weights, 0.0))


def moe_dense(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
              local_ids: torch.Tensor, glu: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
              ) -> torch.Tensor:
    """Every local expert on every token (two batched matmuls), combined with the routing weights.
    glu(gate, up) -> the activated rows (default silu(gate) * up; K3's LatentMoE passes SiTU-GLU)."""
    num_tokens = x.shape[0]
    num_experts, two_inter, hidden = gate_up.shape
    combine = routing_matrix(weights, local_ids, num_experts)
    gate_up_out = F.linear(x, gate_up.reshape(-1, hidden)).view(num_tokens, num_experts, two_inter)
    gate, up = gate_up_out.chunk(2, dim=-1)
    activated = (F.silu(gate) * up if glu is None else glu(gate, up)).transpose(0, 1)  # [E, T, I]
    out = torch.bmm(activated, down.transpose(1, 2)).float()  # [E, T, H]
    return torch.bmm(combine.unsqueeze(1), out.transpose(0, 1)).squeeze(1)
