"""The whole benchmark invocation as one validated, frozen config."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from bench.prefix_workloads import WORKLOADS, ConversationShape, SharedPrefixShape
from bench.slo import SLO

BACKENDS = ("pdserve", "openai")


@dataclass(frozen=True)
class SamplingOptions:
    """What every benchmark request asks for; None leaves the field unset (the server's default)."""

    temperature: float | None = 0.0
    top_p: float | None = None
    top_k: int | None = None
    speculative: bool | None = None
    block_size: int | None = None
    timeout_s: float | None = None
    stream_interval: int | None = None  # tokens per streamed chunk (None: the server's default, every step)

    def __post_init__(self) -> None:
        if self.temperature is not None and not 0.0 <= self.temperature < float("inf"):
            raise ValueError(f"--temperature must be >= 0, got {self.temperature}")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < -1:
            raise ValueError(f"--top-k must be -1 (off) or >= 0, got {self.top_k}")
        if self.block_size is not None and self.block_size < 2:
            raise ValueError(f"--block-size must be >= 2, got {self.block_size}")
        if self.stream_interval is not None and self.stream_interval < 1:
            raise ValueError(f"--stream-interval must be >= 1, got {self.stream_interval}")
        if self.timeout_s is not None and not 0.0 < self.timeout_s < float("inf"):
            raise ValueError(f"--request-timeout must be positive, got {self.timeout_s}")


def parse_sweep(text: str) -> tuple[int, ...]:
    """'1,4,16,64' -> (1, 4, 16, 64); every value a positive integer, no duplicates."""
    values: list[int] = []
    for item in (part.strip() for part in text.split(",")):
        if not item.isdigit() or int(item) <= 0:
            raise ValueError(f"bad concurrency {item!r} in sweep {text!r}: expected positive integers like 1,4,16")
        if int(item) in values:
            raise ValueError(f"concurrency {item} appears twice in sweep {text!r}")
        values.append(int(item))
    return tuple(values)


@dataclass(frozen=True)
class BenchConfig:
    """concurrencies: one run per entry; None = unbounded concurrency (arrivals only limited by
    request_rate). ignore_eos None = on for random prompts, off for a dataset. workload: random (input_len
    prompts, or the dataset), shared-prefix (shared_prefix's shape, num_prompts requests) or multi-turn
    (conversation's shape; input_len is each new user message's length; request_rate does not apply: each
    conversation sends its next turn after its answer and the think time)."""

    gateway: str
    backend: str = "pdserve"  # pdserve: the gRPC API at gateway; openai: the HTTP API at base_url
    base_url: str = "http://127.0.0.1:8000/v1"
    num_prompts: int = 1000
    input_len: int = 1024
    output_len: int = 400
    range_ratio: float = 1.0
    dataset: Path | None = None
    ignore_eos: bool | None = None
    seed: int = 0
    concurrencies: tuple[int | None, ...] = (None,)
    request_rate: float = math.inf
    burstiness: float = 1.0
    warmup_requests: int = 1
    slo: SLO | None = None
    gpus: int = 1
    gpu_price: float | None = None
    output_file: Path | None = None
    plot: Path | None = None
    connect_timeout_s: float = 10.0
    progress: bool = True
    workload: str = "random"
    shared_prefix: SharedPrefixShape = field(default_factory=SharedPrefixShape)
    conversation: ConversationShape = field(default_factory=ConversationShape)

    def __post_init__(self) -> None:
        checks = (
            (bool(self.gateway.strip()), "--gateway must be host:port"),
            (self.backend in BACKENDS, f"--backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}"),
            (self.base_url.startswith(("http://", "https://")), f"--base-url must be an http(s) URL, got {self.base_url!r}"),
            (self.num_prompts > 0, f"--num-prompts must be positive, got {self.num_prompts}"),
            (self.input_len > 0, f"--input-len must be positive, got {self.input_len}"),
            (self.output_len > 0, f"--output-len must be positive, got {self.output_len}"),
            (0.0 <= self.range_ratio <= 1.0, f"--range-ratio must be in [0, 1], got {self.range_ratio}"),
            (self.seed >= 0, f"--seed must be >= 0, got {self.seed}"),
            (len(self.concurrencies) > 0, "at least one concurrency is needed"),
            (all(c is None or c > 0 for c in self.concurrencies), "--max-concurrency must be positive"),
            (self.request_rate > 0, f"--request-rate must be positive (or inf), got {self.request_rate}"),
            (math.isfinite(self.burstiness) and self.burstiness > 0,
             f"--burstiness must be positive and finite, got {self.burstiness}"),
            (self.warmup_requests >= 0, f"--warmup-requests must be >= 0, got {self.warmup_requests}"),
            (self.gpus > 0, f"--gpus must be positive, got {self.gpus}"),
            (self.gpu_price is None or (math.isfinite(self.gpu_price) and self.gpu_price > 0),
             f"--gpu-price must be a positive $/GPU-hour, got {self.gpu_price}"),
            (math.isfinite(self.connect_timeout_s) and self.connect_timeout_s > 0,
             f"--connect-timeout must be positive, got {self.connect_timeout_s}"),
            (self.dataset is None or Path(self.dataset).is_file(), f"--dataset {self.dataset}: no such file"),
            (self.plot is None or Path(self.plot).suffix.lower() == ".png", f"--plot {self.plot}: must end in .png"),
            (self.workload in WORKLOADS, f"--workload must be one of {', '.join(WORKLOADS)}, got {self.workload!r}"),
            (self.workload == "random" or self.dataset is None, f"--workload {self.workload} builds its own prompts: "
             "drop --dataset"),
            (self.workload != "multi-turn" or self.backend == "pdserve", "--workload multi-turn needs --backend "
             "pdserve (each turn resends the model's answer as token ids; the OpenAI API streams text)"),
        )
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def dataset_name(self) -> str:
        return ("random" if self.workload == "random" else self.workload) if self.dataset is None else "jsonl"

    @property
    def num_requests(self) -> int:
        """Measured requests per run."""
        return self.conversation.num_requests if self.workload == "multi-turn" else self.num_prompts

    @property
    def effective_ignore_eos(self) -> bool:
        return self.dataset is None if self.ignore_eos is None else self.ignore_eos
