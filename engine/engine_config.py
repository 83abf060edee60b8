"""The engine's configuration (EngineConfig), built once from the CLI or LLM(...) arguments."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engine.runtime.devices import check_gpus, default_dtype_name, gpu_count, resolve_device
from engine.runtime.model_runner import DTYPES, KV_POOLS
from engine.paths import DEFAULT_MODEL_DIR
from engine.cache.page_pool import PagePoolFactory


@dataclass(frozen=True)
class EngineConfig:
    """Built once from the CLI or LLM(...) arguments. draft_model_dir None = the model's draft/ folder if
    present, "" = no draft. spec_block_size is the server's maximum speculative block size;
    spec_min_tokens_per_step > 1: a sequence whose verify steps emit fewer tokens than this (moving average)
    decodes plainly for a while, then probes again (engine/spec/spec_policy.py; set it to the deployment's spec step /
    plain step cost ratio, ~2 for the embedded models on CPU). kv_pool "shm"
    (CPU shared memory) or "device" (device memory exported over IPC) puts this engine's pages in a pool
    made by page_pools; page_pools also attaches other engines' pools
    (a prefill engine writing into a decode worker's pages). None: private pages only.
    device: "auto" (cuda when a GPU is visible) | "cpu" | "cuda" (also ROCm); gpus: the GPU of each
    rank (rank r -> gpus[r]; None = 0 .. tp_size - 1); dtype "auto": bfloat16 on GPUs, float32 on CPU;
    draft_dtype "auto": the target's dtype; another one runs the draft (weights and activations, and a copy of
    the LM head shard for its logits) in that dtype - the draft only proposes, so outputs do not depend on it;
    use_graphs: capture decode / verify steps as CUDA graphs (ignored on CPU)."""

    model_dir: str = str(DEFAULT_MODEL_DIR)
    tp_size: int = 1
    dtype: str = "auto"
    attention_backend: str = "auto"
    draft_model_dir: str | None = None
    draft_dtype: str = "auto"
    spec_block_size: int = 8
    spec_min_tokens_per_step: float = 0.0  # speculation backs off below this many tokens per verify step (0: never)
    page_size: int = 16
    kv_memory_bytes: int = 512 * 2**20
    max_running: int = 64
    state_memory_fraction: float = 0.5  # the most of kv_memory_bytes KDA state slots + verify scratch may take
    max_batched_tokens: int = 2048
    kv_pool: str = "local"
    num_threads: int | None = None
    device: str = "auto"
    gpus: tuple[int, ...] | None = None
    use_graphs: bool = True
    share_weights: bool = False  # workers: map one copy of the weights per node (engine/weights/weight_store.py)
    page_pools: PagePoolFactory | None = None
    prefix_cache: bool = True  # reuse computed pages (and KDA state checkpoints) across requests (engine/cache/prefix_cache.py)
    # KDA models: a state checkpoint every this many prompt tokens (a page multiple; prefill chunks end there). 128:
    # a cold 1,024-token K3-tiny prefill cost the same CPU time in chunks of 128 as in one (0.31 vs 0.36 s, 7 reps),
    # 64 cost 13% more; 128 keeps a hit within 128 tokens of any shared prefix's end.
    state_checkpoint_interval: int = 128
    checkpoint_memory_fraction: float = 0.125  # the most of kv_memory_bytes the KDA state checkpoints may take
    # >0 (decode workers, which prefill short suffixes themselves): while sequences decode, a prefill step takes at most
    # this many tokens and alternates with decode steps, so local prefills never stall running decodes for long
    # (engine/runtime/scheduler.py). 0: prefill first, max_batched_tokens per step.
    prefill_tokens_while_decoding: int = 0
    # With prefill_tokens_while_decoding: those bounded chunks join the decode step (one MIXED forward, the weights
    # read once for both) instead of alternating with it; steps still alternate while a sequence may speculate.
    mixed_steps: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "device", resolve_device(self.device))  # "auto" resolved once, here
        if self.gpus is not None:
            object.__setattr__(self, "gpus", tuple(self.gpus))
        if not Path(self.model_dir, "config.json").is_file():
            raise ValueError(f"model_dir {self.model_dir!r} has no config.json")
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.tp_size}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.draft_dtype != "auto" and self.draft_dtype not in DTYPES:
            raise ValueError(f"draft_dtype must be 'auto' or one of {sorted(DTYPES)}, got {self.draft_dtype!r}")
        if self.device == "cuda":
            check_gpus(self.tp_size, self.gpus, gpu_count())
            if self.kv_pool == "shm":
                raise ValueError("kv_pool 'shm' is a CPU shared-memory pool; on device cuda the engine needs "
                                 "kv_pool 'local' or 'device' (a device pool exported over IPC)")
        if self.spec_block_size < 2:
            raise ValueError(f"spec_block_size must be >= 2, got {self.spec_block_size}")
        if not self.spec_min_tokens_per_step >= 0.0:
            raise ValueError(f"spec_min_tokens_per_step must be >= 0, got {self.spec_min_tokens_per_step!r}")
        if not 0.0 < self.state_memory_fraction < 1.0:
            raise ValueError(f"state_memory_fraction must be in (0, 1), got {self.state_memory_fraction}")
        if self.prefill_tokens_while_decoding < 0:
            raise ValueError(f"prefill_tokens_while_decoding must be >= 0, got {self.prefill_tokens_while_decoding}")
        if self.page_size <= 0 or self.kv_memory_bytes <= 0:
            raise ValueError("page_size and kv_memory_bytes must be positive")
        if self.kv_pool not in KV_POOLS:
            raise ValueError(f"kv_pool must be one of {KV_POOLS}, got {self.kv_pool!r}")
        if self.kv_pool != "local" and self.page_pools is None:
            raise ValueError(f"kv_pool {self.kv_pool!r} needs page_pools (e.g. kvtransfer.shm_pool.ShmPoolFactory())")
        if self.state_checkpoint_interval <= 0 or self.state_checkpoint_interval % self.page_size:
            raise ValueError(f"state_checkpoint_interval must be a positive multiple of page_size {self.page_size}, "
                             f"got {self.state_checkpoint_interval}")
        if not 0.0 <= self.checkpoint_memory_fraction < 1.0:
            raise ValueError(f"checkpoint_memory_fraction must be in [0, 1), got {self.checkpoint_memory_fraction}")
        if self.draft_model_dir and not Path(self.draft_model_dir, "config.json").is_file():
            raise ValueError(f"draft_model_dir {self.draft_model_dir!r} has no config.json")

    @property
    def resolved_device(self) -> str:
        """"cpu" or "cuda" ("auto" is resolved at construction)."""
        return self.device

    @property
    def torch_dtype_name(self) -> str:
        return default_dtype_name(self.device) if self.dtype == "auto" else self.dtype

    @property
    def draft_dtype_name(self) -> str:
        return self.torch_dtype_name if self.draft_dtype == "auto" else self.draft_dtype

    @property
    def rank_gpus(self) -> tuple[int, ...]:
        """The GPU index of each rank (empty on CPU)."""
        return () if self.device == "cpu" else (self.gpus or tuple(range(self.tp_size)))[: self.tp_size]

    @property
    def resolved_draft_dir(self) -> str | None:
        if self.draft_model_dir is None:
            default = Path(self.model_dir, "draft")
            return str(default) if (default / "config.json").is_file() else None
        return self.draft_model_dir or None
