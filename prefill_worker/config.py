"""Prefill worker settings, built once from the command line: one EngineConfig plus the prefill role's."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.engine_config import EngineConfig
from engine.runtime.devices import serving_device
from engine.runtime.role_config import EmbedsEngineConfig, worker_engine_config
from kvtransfer.device_pool import DevicePoolFactory
from prefill_worker.batch_policy import DEFAULT_BATCH_TARGET_MS
from rpc.core_board import DEFAULT_BORROW_STEP_TOKENS, MAX_PREFILL_SLOTS

DEFAULT_KV_MEMORY_BYTES = 256 * 2**20  # the local pool: used only by the grpc transport (compute, then push)


@dataclass(frozen=True)
class PrefillWorkerConfig(EmbedsEngineConfig):
    """engine.max_batched_tokens: the engine's prefill chunk (tokens per forward); batch_tokens: prompt
    tokens taken from the queue into one engine.prefill call (several prompts per step); batch_target_ms:
    fewer, when the engine's measured cost says batch_tokens would take longer than this (0: no time cap;
    prefill_worker/batch_policy.py)."""

    engine: EngineConfig
    listen: str = "127.0.0.1:0"
    metrics_listen: str = ""  # Prometheus GET /metrics ("": none; port 0 picks one)
    batch_tokens: int = 2048
    batch_target_ms: float = DEFAULT_BATCH_TARGET_MS
    internal_token: str | None = field(default=None, repr=False)  # required on calls, sent with KV pushes
    core_board: str | None = None  # core lending (rpc/core_board.py): this worker marks its forwards there
    core_board_slot: int = 0  # its byte on the board (one per prefill worker)
    borrow_cpus: tuple[int, ...] = ()  # the decode workers' CPUs: its steps run there too while decode idles
    borrow_threads: int | None = None  # torch threads added then (None: one per borrowed core)

    def __post_init__(self) -> None:
        self.check_addresses()
        if not 0 <= self.core_board_slot < MAX_PREFILL_SLOTS:
            raise ValueError(f"core_board_slot must be in 0..{MAX_PREFILL_SLOTS - 1}, got {self.core_board_slot}")
        if self.borrow_cpus and not self.core_board:
            raise ValueError("borrow_cpus needs a core_board (the decode workers say there when they are idle)")
        if self.batch_tokens <= 0:
            raise ValueError(f"batch_tokens must be positive, got {self.batch_tokens}")
        if self.batch_target_ms < 0:
            raise ValueError(f"batch_target_ms must be >= 0 (0: no time cap), got {self.batch_target_ms}")

    @classmethod
    def build(cls, *, listen: str = "127.0.0.1:0", metrics_listen: str = "", batch_tokens: int = 2048,
              batch_target_ms: float = DEFAULT_BATCH_TARGET_MS, internal_token: str | None = None,
              core_board: str | None = None, core_board_slot: int = 0, borrow_cpus: tuple[int, ...] = (),
              borrow_threads: int | None = None, borrow_step_tokens: int = DEFAULT_BORROW_STEP_TOKENS,
              **engine: object) -> PrefillWorkerConfig:
        """engine: EngineConfig fields. The prefill role computes into private pages and attaches decode
        workers' shared pools: shm pools and device pools, by name (DevicePoolFactory.attach). With borrow_cpus
        the engine's steps take at most borrow_step_tokens prompt tokens (max_batched_tokens capped): a decode
        worker that gets work waits at most one step for its cores."""
        if borrow_cpus:
            if borrow_step_tokens <= 0:
                raise ValueError(f"borrow_step_tokens must be positive, got {borrow_step_tokens}")
            engine["max_batched_tokens"] = min(int(engine.get("max_batched_tokens", EngineConfig.max_batched_tokens)),
                                               borrow_step_tokens)
        device = serving_device(engine.get("device", "auto"))
        engine = worker_engine_config({"kv_memory_bytes": DEFAULT_KV_MEMORY_BYTES, **engine}, kv_pool="local",
                                      page_pools=DevicePoolFactory(device, tuple(engine.get("gpus") or ())))
        return cls(engine, listen, metrics_listen, batch_tokens, batch_target_ms, internal_token, core_board,
                   core_board_slot, tuple(borrow_cpus), borrow_threads)
