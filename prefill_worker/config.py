"""Prefill worker settings, built once from the command line."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.devices import serving_device
from engine.llm_engine import EngineConfig
from kvtransfer.shm_pool import ShmPoolFactory


@dataclass(frozen=True)
class PrefillWorkerConfig:
    """max_batched_tokens: the engine's prefill chunk (tokens per forward); batch_tokens: prompt tokens
    taken from the queue into one engine.prefill call (several prompts per step). kv_memory_bytes sizes
    the local pool, used only by the grpc transport (prompts are computed there, then pushed)."""

    model_dir: str
    listen: str = "127.0.0.1:0"
    metrics_listen: str = ""  # Prometheus GET /metrics ("": none; port 0 picks one)
    tp_size: int = 1
    draft_model_dir: str | None = None
    attention_backend: str = "auto"
    dtype: str = "auto"
    page_size: int = 16
    kv_memory_bytes: int = 256 * 2**20
    max_batched_tokens: int = 2048
    batch_tokens: int = 2048
    spec_block_size: int = 8
    num_threads: int | None = None
    device: str = "auto"
    gpus: tuple[int, ...] | None = None
    use_graphs: bool = True
    share_weights: bool = True
    internal_token: str | None = field(default=None, repr=False)  # required on calls, sent with KV pushes

    def __post_init__(self) -> None:
        if not self.listen or ":" not in self.listen:
            raise ValueError(f"listen must be host:port, got {self.listen!r}")
        if self.metrics_listen and ":" not in self.metrics_listen:
            raise ValueError(f"metrics_listen must be host:port, got {self.metrics_listen!r}")
        if self.batch_tokens <= 0 or self.max_batched_tokens <= 0:
            raise ValueError("batch_tokens and max_batched_tokens must be positive")

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            model_dir=self.model_dir, tp_size=self.tp_size, dtype=self.dtype, attention_backend=self.attention_backend,
            draft_model_dir=self.draft_model_dir, spec_block_size=self.spec_block_size, page_size=self.page_size,
            kv_memory_bytes=self.kv_memory_bytes, max_batched_tokens=self.max_batched_tokens, kv_pool="local",
            num_threads=self.num_threads, page_pools=ShmPoolFactory(),  # attaches decode workers' pools
            share_weights=self.share_weights,
            device=serving_device(self.device), gpus=self.gpus, use_graphs=self.use_graphs,
        )
