"""One capacity plan as plain data (numbers in bytes, tokens, GPUs, $): what the table and --json show."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from pdserve.plan import capacity
from pdserve.plan.capacity import PlanRequest
from pdserve.plan.heads import HeadPlan


@dataclass(frozen=True)
class CapacityPlan:
    model: dict[str, Any]
    gpu: dict[str, Any]
    deployment: dict[str, Any]
    weights: dict[str, Any]
    kv: dict[str, Any]
    heads: HeadPlan
    scale: dict[str, Any]
    cost: dict[str, Any]
    fits: bool
    sharing: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["heads"]["padding_overhead"] = self.heads.padding_overhead
        return data


def build_plan(request: PlanRequest, model_name: str, source: str, params_computed: int) -> CapacityPlan:
    """Runs every calculation of capacity.py for one request."""
    config, gpu = request.model, request.gpu
    total_bytes, per_gpu_bytes = capacity.weight_bytes(request.params, request.quantization, request.tp_size)
    budget = capacity.kv_budget(request, request.tp_size)
    checkpoints = capacity.checkpoint_bytes(request, request.tp_size)
    per_token = capacity.kv_bytes_per_token(config, request.kv_dtype, request.hybrid)
    tokens_per_gpu = max(budget - checkpoints, 0) // per_token
    sequences_per_replica = max(budget - checkpoints, 0) // capacity.bytes_per_sequence(request, request.tp_size)
    min_tp = capacity.smallest_tp(request)
    price_hour = capacity.cost_per_hour(request)
    cost: dict[str, Any] = {
        "price_per_gpu_hour": gpu.price_per_hour, "price_source": gpu.price_source, "gpus": request.gpus,
        "dollars_per_hour": price_hour, "throughput_tok_s": request.throughput,
        "tok_s_per_dollar": None, "dollars_per_million_tokens": None,
    }
    if request.throughput is not None:
        cost["tok_s_per_dollar"] = capacity.tok_s_per_dollar(request.throughput, request.gpus, gpu.price_per_hour)
        cost["dollars_per_million_tokens"] = price_hour / (request.throughput * 3600) * 1e6
    return CapacityPlan(
        model={
            "name": model_name, "source": source, "layers": config.num_hidden_layers,
            "attention_heads": config.num_attention_heads, "kv_lora_rank": config.kv_lora_rank,
            "rope_dim": config.qk_rope_head_dim, "routed_experts": config.n_routed_experts,
            "experts_per_token": config.num_experts_per_tok,
            "latent_moe_width": getattr(config, "routed_expert_hidden_size", None),
            "kda_layers": 0 if request.hybrid is None else request.hybrid.kda_layers,
            "kda_heads": 0 if request.hybrid is None else request.hybrid.kda_heads,
            "params_total": request.params.total, "params_computed": params_computed,
            "params_by_group": request.params.as_dict(),
        },
        gpu={"name": gpu.name, "memory_bytes": gpu.memory_bytes, "vendor": gpu.vendor},
        deployment={
            "gpus": request.gpus, "tp_size": request.tp_size, "replicas": request.replicas,
            "gpus_per_node": request.gpus_per_node, "nodes": math.ceil(request.gpus / request.gpus_per_node),
            "tp_spans_nodes": request.tp_size > request.gpus_per_node,
        },
        weights={
            "linear_format": request.quantization.linear.describe(),
            "expert_format": request.quantization.experts.describe(),
            "linear_bits_per_weight": request.quantization.linear.bits_per_weight,
            "expert_bits_per_weight": request.quantization.experts.bits_per_weight,
            "bits_per_weight": total_bytes * 8 / request.params.total,
            "total_bytes": total_bytes, "per_gpu_bytes": per_gpu_bytes,
            "reserve_bytes_per_gpu": request.reserve_bytes, "fit_per_gpu": budget >= 0,
        },
        kv={
            "dtype": request.kv_dtype, "bytes_per_token": per_token, "budget_bytes_per_gpu": budget,
            "mla_layers": config.num_hidden_layers if request.hybrid is None else request.hybrid.mla_layers,
            "state_bytes_per_request": request.state_bytes_per_request,
            "checkpoint_bytes_per_gpu": checkpoints,
            "checkpoints_per_gpu": checkpoints // request.state_bytes_per_request if checkpoints else 0,
            "checkpoint_fraction": request.checkpoint_fraction if request.hybrid is not None else 0.0,
            "tokens_per_gpu": tokens_per_gpu, "context_len": request.context_len,
            "sequences_per_replica": sequences_per_replica,
            "concurrent_sequences": sequences_per_replica * request.replicas,
        },
        heads=capacity.heads(request),
        scale={
            "min_gpus": min_tp, "min_nodes": None if min_tp is None else math.ceil(min_tp / request.gpus_per_node),
            "one_node_suffices": min_tp is not None and min_tp <= request.gpus_per_node,
        },
        cost=cost,
        fits=sequences_per_replica >= 1,
        sharing=capacity.node_weight_copies(request),
    )
