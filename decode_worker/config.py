"""Decode worker settings, built once from the command line: one EngineConfig plus the decode role's."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.engine_config import EngineConfig
from engine.runtime.devices import serving_device
from engine.runtime.role_config import EmbedsEngineConfig, worker_engine_config
from kvtransfer.device_pool import DevicePoolFactory
from kvtransfer.shm_pool import ShmPoolFactory
from rpc.core_board import MAX_DECODE_SLOTS


# Local prefills (conditional disaggregation) take at most this many tokens per engine step while requests decode
# (docs/services.md, "Conditional disaggregation": the measurement).
DEFAULT_LOCAL_PREFILL_TOKENS_PER_STEP = 128


@dataclass(frozen=True)
class DecodeWorkerConfig(EmbedsEngineConfig):
    """engine.draft_model_dir: None = the model's draft/ folder if present, "" = no speculative decoding.
    advertise_address: host:port prefill workers push KV to (grpc transport); None = the bound address.
    The engine (and its TP followers) runs in an engine process of its own, fed through pipes
    (decode_worker/process_port.py)."""

    engine: EngineConfig
    listen: str = "127.0.0.1:0"
    metrics_listen: str = ""  # Prometheus GET /metrics ("": none; port 0 picks one)
    lease_ttl_s: float = 60.0
    lease_grace_s: float = 1.0
    lease_sweep_interval_s: float = 0.25
    admit_timeout_s: float = 10.0
    advertise_address: str | None = None
    internal_token: str | None = field(default=None, repr=False)  # calls must carry it (TCP deployments)
    core_board: str | None = None  # core lending (rpc/core_board.py): the board shared with the prefill workers
    borrow_cpus: tuple[int, ...] = ()  # their cores, used while every prefill worker on the board is idle
    core_board_slot: int = 0  # this decode worker's byte on the board
    borrow_threads: int | None = None  # threads added while borrowing (None: one per borrowed core)

    def __post_init__(self) -> None:
        self.check_addresses()
        if bool(self.core_board) != bool(self.borrow_cpus):
            raise ValueError("core lending needs both --core-board and --borrow-cpus")
        if self.core_board and (self.engine.device != "cpu" or self.engine.tp_size != 1):
            raise ValueError("core lending applies to a CPU decode worker with TP 1 (its one process's threads)")
        if not 0 <= self.core_board_slot < MAX_DECODE_SLOTS:
            raise ValueError(f"core_board_slot must be in 0..{MAX_DECODE_SLOTS - 1}, got {self.core_board_slot}")
        if self.borrow_threads is not None and self.borrow_threads < 0:
            raise ValueError(f"borrow_threads must be >= 0, got {self.borrow_threads}")
        for name in ("lease_ttl_s", "lease_sweep_interval_s", "admit_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.lease_grace_s < 0:
            raise ValueError("lease_grace_s must be non-negative")
        if self.engine.kv_pool not in ("shm", "device"):
            raise ValueError("a decode worker's pages live in a shared pool (engine kv_pool 'shm' or 'device')")

    @classmethod
    def build(cls, *, listen: str = "127.0.0.1:0", metrics_listen: str = "", lease_ttl_s: float = 60.0,
              lease_grace_s: float = 1.0, lease_sweep_interval_s: float = 0.25, admit_timeout_s: float = 10.0,
              advertise_address: str | None = None, internal_token: str | None = None, kv_pool: str = "auto",
              core_board: str | None = None, borrow_cpus: tuple[int, ...] = (), core_board_slot: int = 0,
              borrow_threads: int | None = None, **engine: object) -> DecodeWorkerConfig:
        """engine: EngineConfig fields. The decode role keeps its pages in shared pools prefill workers
        write into: kv_pool "shm" (CPU shared memory, ShmPoolFactory), "device" (device memory exported over
        IPC, DevicePoolFactory; on the CPU the memfd stand-in) or "auto" (device on a GPU, else shm).
        The decode role bounds the prompts it prefills itself (DecodeRequest.prefill_locally): unless given,
        engine prefill_tokens_while_decoding is DEFAULT_LOCAL_PREFILL_TOKENS_PER_STEP (`--local-prefill-tokens-per-step`:
        while requests decode, a prefill step takes at most that many tokens and joins a decode step, or with
        mixed_steps off alternates with them)."""
        engine.setdefault("prefill_tokens_while_decoding", DEFAULT_LOCAL_PREFILL_TOKENS_PER_STEP)
        if kv_pool not in ("auto", "shm", "device"):
            raise ValueError(f"kv_pool must be auto, shm or device, got {kv_pool!r}")
        device = serving_device(engine.get("device", "auto"))
        if kv_pool == "auto":
            kv_pool = "device" if device == "cuda" else "shm"
        factory = (DevicePoolFactory(device, tuple(engine.get("gpus") or ())) if kv_pool == "device"
                   else ShmPoolFactory())
        return cls(worker_engine_config(engine, kv_pool=kv_pool, page_pools=factory), listen, metrics_listen,
                   lease_ttl_s, lease_grace_s, lease_sweep_interval_s, admit_timeout_s, advertise_address,
                   internal_token, core_board, tuple(borrow_cpus), core_board_slot, borrow_threads)
