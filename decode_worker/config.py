"""Decode worker settings, built once from the command line."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.devices import serving_device
from engine.llm_engine import EngineConfig
from kvtransfer.shm_pool import ShmPoolFactory


@dataclass(frozen=True)
class DecodeWorkerConfig:
    """draft_model_dir: None = the model's draft/ folder if present, "" = no speculative decoding.
    advertise_address: host:port prefill workers push KV to (grpc transport); None = the bound address."""

    model_dir: str
    listen: str = "127.0.0.1:0"
    metrics_listen: str = ""  # Prometheus GET /metrics ("": none; port 0 picks one)
    tp_size: int = 1
    draft_model_dir: str | None = None
    attention_backend: str = "auto"
    dtype: str = "auto"
    page_size: int = 16
    kv_memory_bytes: int = 512 * 2**20
    max_running: int = 64
    max_batched_tokens: int = 2048
    spec_block_size: int = 8
    num_threads: int | None = None
    device: str = "auto"
    gpus: tuple[int, ...] | None = None
    use_graphs: bool = True
    share_weights: bool = True
    lease_ttl_s: float = 60.0
    lease_grace_s: float = 1.0
    lease_sweep_interval_s: float = 0.25
    admit_timeout_s: float = 10.0
    advertise_address: str | None = None
    internal_token: str | None = field(default=None, repr=False)  # calls must carry it (TCP deployments)

    def __post_init__(self) -> None:
        if not self.listen or ":" not in self.listen:
            raise ValueError(f"listen must be host:port, got {self.listen!r}")
        if self.metrics_listen and ":" not in self.metrics_listen:
            raise ValueError(f"metrics_listen must be host:port, got {self.metrics_listen!r}")
        for name in ("lease_ttl_s", "lease_sweep_interval_s", "admit_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.lease_grace_s < 0:
            raise ValueError("lease_grace_s must be non-negative")

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            model_dir=self.model_dir, tp_size=self.tp_size, dtype=self.dtype, attention_backend=self.attention_backend,
            draft_model_dir=self.draft_model_dir, spec_block_size=self.spec_block_size, page_size=self.page_size,
            kv_memory_bytes=self.kv_memory_bytes, max_running=self.max_running,
            max_batched_tokens=self.max_batched_tokens, kv_pool="shm", num_threads=self.num_threads,
            device=serving_device(self.device), gpus=self.gpus, use_graphs=self.use_graphs,
            share_weights=self.share_weights,
            page_pools=ShmPoolFactory(),
        )
