"""The capacity arithmetic: weights and KV per GPU, sequences that fit, nodes needed, tok/s per dollar.
Pure functions of a PlanRequest; nothing here reads files or prints."""
from __future__ import annotations

import math
from dataclasses import dataclass

from engine.model_configs.model_config import ModelConfig
from pdserve.plan.dtypes import UNQUANTISED_BITS, Quantization, kv_bytes
from pdserve.plan.gpus import GB, GpuSpec
from pdserve.plan.heads import HeadPlan, plan_heads
from pdserve.plan.hybrid import HybridAttention
from pdserve.plan.params import REPLICATED_GROUPS, ParamBreakdown


_COUNTS = {"gpus": "GPU count", "tp_size": "TP size", "gpus_per_node": "GPUs per node",
           "context_len": "context length"}


@dataclass(frozen=True)
class PlanRequest:
    """Everything one plan needs, validated once. gpus = tp_size x replicas (each replica holds the
    whole model over tp_size GPUs); reserve = reserve_fraction x GPU memory + reserve_gb, kept free
    for activations, the draft model, graphs and fragmentation."""

    model: ModelConfig
    params: ParamBreakdown
    quantization: Quantization
    gpu: GpuSpec
    gpus: int
    tp_size: int
    kv_dtype: str = "bf16"
    gpus_per_node: int = 8
    context_len: int = 8192
    reserve_fraction: float = 0.10
    reserve_gb: float = 0.0
    throughput: float | None = None  # measured tok/s of the whole deployment
    hybrid: HybridAttention | None = None  # KDA + MLA models: MLA layer count and per-request state
    checkpoint_fraction: float = 0.125  # KDA models: the prefix cache's state checkpoints' share of the KV budget

    def __post_init__(self) -> None:
        for name, label in _COUNTS.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{label} must be a positive integer, got {value!r}")
        if self.model.num_attention_heads % self.tp_size:
            raise ValueError(f"TP size {self.tp_size} does not divide the model's {self.model.num_attention_heads} "
                             f"attention heads (TP sizes it splits over: {_divisors_text(self.model)})")
        self.model.validate_tp(self.tp_size)
        if self.gpus % self.tp_size:
            raise ValueError(f"{self.gpus} GPUs cannot be split into TP groups of {self.tp_size}")
        if not 0 <= self.reserve_fraction < 1:
            raise ValueError(f"reserve fraction must be in [0, 1), got {self.reserve_fraction}")
        if not self.reserve_gb >= 0:
            raise ValueError(f"reserve must be >= 0 GB, got {self.reserve_gb}")
        if self.throughput is not None and not self.throughput > 0:
            raise ValueError(f"throughput must be positive tok/s, got {self.throughput}")
        if not 0 <= self.checkpoint_fraction < 1:
            raise ValueError(f"checkpoint memory fraction must be in [0, 1), got {self.checkpoint_fraction}")
        kv_bytes(self.kv_dtype)
        self.state_bytes_per_request

    @property
    def replicas(self) -> int:
        return self.gpus // self.tp_size

    @property
    def state_bytes_per_request(self) -> int:
        """Per-request KDA state on each GPU (0 for pure-MLA models)."""
        return 0 if self.hybrid is None else self.hybrid.state_bytes_per_request(self.tp_size)

    @property
    def reserve_bytes(self) -> int:
        return int(self.gpu.memory_bytes * self.reserve_fraction + self.reserve_gb * GB)


def valid_tp_sizes(model: ModelConfig) -> list[int]:
    """TP sizes the engine can split this model over (heads, vocab, MLP and experts all divide)."""
    sizes = []
    for tp_size in range(1, model.num_attention_heads + 1):
        try:
            model.validate_tp(tp_size)
        except ValueError:
            continue
        sizes.append(tp_size)
    return sizes


def _divisors_text(model: ModelConfig) -> str:
    return ", ".join(str(size) for size in valid_tp_sizes(model))


def group_bits(quantization: Quantization) -> dict[str, float]:
    """Bits per weight of every parameter group."""
    linear, experts = quantization.linear.bits_per_weight, quantization.experts.bits_per_weight
    return {
        "embedding": UNQUANTISED_BITS, "lm_head": UNQUANTISED_BITS, "router": UNQUANTISED_BITS,
        "norms": UNQUANTISED_BITS, "attention_sharded": linear, "attention_replicated": linear,
        "dense_mlp": linear, "shared_experts": linear, "routed_experts": experts, "latent_projections": linear,
    }


def weight_bytes(params: ParamBreakdown, quantization: Quantization, tp_size: int) -> tuple[int, int]:
    """(bytes of one full copy, bytes on each GPU of a TP group): split groups / tp + replicated groups."""
    bits = group_bits(quantization)
    sizes = {name: count * bits[name] / 8 for name, count in params.as_dict().items()}
    replicated = sum(sizes[name] for name in REPLICATED_GROUPS)
    total = sum(sizes.values())
    return math.ceil(total), math.ceil((total - replicated) / tp_size + replicated)


def kv_bytes_per_token(model: ModelConfig, kv_dtype: str, hybrid: HybridAttention | None = None) -> int:
    """MLA latent per token: MLA layers x (kv_lora_rank + rope dim) x dtype bytes, the same on every TP rank
    (a hybrid model caches only its MLA layers)."""
    layers = model.num_hidden_layers if hybrid is None else hybrid.mla_layers
    return layers * (model.kv_lora_rank + model.qk_rope_head_dim) * kv_bytes(kv_dtype)


def bytes_per_sequence(request: PlanRequest, tp_size: int) -> int:
    """One sequence of context_len tokens on each GPU: its MLA latents plus its KDA state."""
    state = 0 if request.hybrid is None else request.hybrid.state_bytes_per_request(tp_size)
    return kv_bytes_per_token(request.model, request.kv_dtype, request.hybrid) * request.context_len + state


def kv_budget(request: PlanRequest, tp_size: int) -> int:
    """Bytes left for the KV pool on each GPU (negative: the weights alone do not fit)."""
    _, per_gpu = weight_bytes(request.params, request.quantization, tp_size)
    return request.gpu.memory_bytes - per_gpu - request.reserve_bytes


def checkpoint_bytes(request: PlanRequest, tp_size: int) -> int:
    """Bytes of the prefix cache's KDA state checkpoints on each GPU (whole checkpoints within checkpoint_fraction
    of the KV budget, as the engine sizes them; 0 for pure-MLA models): what is left holds pages and state slots."""
    if request.hybrid is None:
        return 0
    state = request.hybrid.state_bytes_per_request(tp_size)
    return int(max(kv_budget(request, tp_size), 0) * request.checkpoint_fraction) // state * state


def smallest_tp(request: PlanRequest) -> int | None:
    """The fewest GPUs (a TP size the engine can split the model over) that hold the weights, the
    reserve and one sequence of context_len tokens; None if even TP = heads does not."""
    def fits(size: int) -> bool:
        if request.hybrid is not None and request.hybrid.kda_heads % size:
            return False
        return kv_budget(request, size) >= bytes_per_sequence(request, size)

    return next((size for size in valid_tp_sizes(request.model) if fits(size)), None)


def heads(request: PlanRequest) -> HeadPlan:
    return plan_heads(request.model.num_attention_heads, request.tp_size)


def cost_per_hour(request: PlanRequest) -> float:
    return request.gpus * request.gpu.price_per_hour


def tok_s_per_dollar(throughput: float, gpus: int, price_per_hour: float) -> float:
    """The seed's figure of merit: tok/s / (GPUs x $/GPU-hour)."""
    if throughput <= 0 or gpus <= 0 or price_per_hour <= 0:
        raise ValueError("throughput, GPU count and price must be positive")
    return throughput / (gpus * price_per_hour)


def node_weight_copies(request: PlanRequest) -> dict[str, object]:
    """Whether one node holds the weights once (prefill and decode workers both TP over all its GPUs,
    mapping one shared copy) or once per worker (each worker loads its own): per-GPU bytes and fits.
    Without sharing, the alternative to two copies on every GPU is splitting the node in halves, each half
    holding a whole copy over gpus/2 GPUs: reported too."""
    gpus = request.gpus_per_node
    free = request.gpu.memory_bytes - request.reserve_bytes
    _, per_gpu = weight_bytes(request.params, request.quantization, gpus)
    half = gpus // 2
    split_per_gpu = weight_bytes(request.params, request.quantization, half)[1] if half >= 1 else None
    split_ok = split_per_gpu is not None and half in valid_tp_sizes(request.model) and split_per_gpu <= free
    return {
        "gpus": gpus, "per_gpu_shared_bytes": per_gpu, "fits_shared": per_gpu <= free,
        "kv_budget_shared_bytes": free - per_gpu,
        "per_gpu_per_worker_bytes": 2 * per_gpu, "fits_per_worker": 2 * per_gpu <= free,
        "split_gpus_per_worker": half, "split_per_gpu_bytes": split_per_gpu, "fits_split": split_ok,
    }


__all__ = ["PlanRequest", "bytes_per_sequence", "checkpoint_bytes", "cost_per_hour", "group_bits", "heads", "kv_budget",
           "kv_bytes_per_token", "node_weight_copies", "smallest_tp", "tok_s_per_dollar", "valid_tp_sizes",
           "weight_bytes"]
