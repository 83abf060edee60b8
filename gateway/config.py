"""Gateway settings, built once from the command line."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from gateway.liveness import LivenessConfig
from gateway.migration import MigrationConfig
from gateway.router import CacheWeights
from gateway.transport_choice import TRANSPORT_NAMES as TRANSPORTS

DEFAULT_STANDING_LEASE_TOKENS = 1024  # prompt tokens of a spare reservation per decode worker (0: none)
# Conditional disaggregation: a prompt whose part the decode worker does not hold is shorter than this is prefilled
# by the decode worker itself (no Prefill RPC, no KV handoff). 0: always a prefill worker. The default is measured
# (docs/services.md, "Conditional disaggregation").
DEFAULT_DISAGG_THRESHOLD_TOKENS = 256
# One uncached prompt page costs as much as one page of load: the prefill worker with the least work in front of the
# request plus its uncached part wins (docs/services.md).
DEFAULT_CACHE_ROUTING_WEIGHT = 1.0


@dataclass(frozen=True)
class GatewayConfig:
    """prefill / decode: worker addresses (host:port). transport: how prefill hands KV to decode
    ("auto": chosen per request from where both workers are, gateway/transport_choice.py; "shm" and
    "device" need both on one host). admission_timeout_s: how long a request waits for a decode worker
    with room (Reserve answers RESOURCE_EXHAUSTED) before it fails with RESOURCE_EXHAUSTED (HTTP 429).
    http_listen: where the HTTP front (OpenAI API, /health, /metrics) listens; port 0 picks one.
    max_request_bytes: the largest request message (and prompt text) accepted, checked before parsing /
    tokenising; tokenize_inline_chars / tokenize_processes: texts longer than this are tokenised in that
    many spawned processes, off the event loop (0 processes: inline). internal_token: sent to the
    workers (TCP deployments); api_keys: clients must send one as `authorization: Bearer <key>` (none:
    no authentication; health checks need none); tls_cert / tls_key: PEM files, serve TLS only.
    standing_lease_tokens: > 0 (the default, DEFAULT_STANDING_LEASE_TOKENS) keeps one spare reservation of that
    many prompt tokens per decode worker with room for two (gateway/standing_leases.py), taken by a request
    whose prompt fits instead of a Reserve round trip before its prefill; longer prompts Reserve as before
    (0: off); standing_lease_ttl_s: the lease a spare asks for. disagg_threshold_tokens: a request whose prompt,
    past what its decode worker holds in its prefix cache, is shorter than this is prefilled by the decode worker
    itself (gateway/orchestrator.prefills_locally; 0: always by a prefill worker). cache_routing_weight: the cost
    of one uncached prompt page against one page of load when picking workers (gateway/router.py,
    docs/services.md; 0: load only); cache_routing_max_load: the fraction of its pages a decode worker may use
    before its cache stops counting."""

    model_dir: str
    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    listen: str = "127.0.0.1:50051"
    http_listen: str = ""  # OpenAI-compatible HTTP, /health and /metrics ("": none)
    transport: str = "auto"
    default_max_tokens: int = 256
    load_poll_interval_s: float = 0.2
    worker_timeout_s: float = 2.0
    admission_timeout_s: float = 30.0
    cleanup_timeout_s: float = 10.0
    max_request_bytes: int = 4 * 2**20
    tokenize_inline_chars: int = 4096
    tokenize_processes: int = 1
    internal_token: str | None = field(default=None, repr=False)
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    tls_cert: str | None = None
    tls_key: str | None = None
    standing_lease_tokens: int = DEFAULT_STANDING_LEASE_TOKENS
    standing_lease_ttl_s: float = 30.0
    disagg_threshold_tokens: int = DEFAULT_DISAGG_THRESHOLD_TOKENS  # gateway/orchestrator.prefills_locally
    cache_routing_weight: float = DEFAULT_CACHE_ROUTING_WEIGHT
    cache_routing_max_load: float = 0.9
    liveness: LivenessConfig = field(default_factory=LivenessConfig)  # decode hang detection (gateway/liveness.py)
    migration: MigrationConfig = field(default_factory=MigrationConfig)  # request migration (gateway/migration.py)

    @property
    def cache_weights(self) -> CacheWeights:
        return CacheWeights(self.cache_routing_weight, self.cache_routing_max_load)

    def __post_init__(self) -> None:
        object.__setattr__(self, "prefill", tuple(self.prefill))
        object.__setattr__(self, "decode", tuple(self.decode))
        if not self.prefill or not self.decode:
            raise ValueError("the gateway needs at least one prefill and one decode worker")
        for address in (*self.prefill, *self.decode, self.listen, *([self.http_listen] if self.http_listen else [])):
            if ":" not in address:
                raise ValueError(f"worker and listen addresses must be host:port, got {address!r}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if self.default_max_tokens <= 0:
            raise ValueError("default_max_tokens must be positive")
        object.__setattr__(self, "api_keys", tuple(self.api_keys))
        if not all(self.api_keys):
            raise ValueError("api_keys must not contain an empty key")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together")
        for path in (self.tls_cert, self.tls_key):
            if path is not None and not Path(path).is_file():
                raise ValueError(f"TLS file {path!r} does not exist")
        if self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes must be at least 1024, got {self.max_request_bytes}")
        if self.tokenize_inline_chars < 0 or self.tokenize_processes < 0:
            raise ValueError("tokenize_inline_chars and tokenize_processes must be non-negative")
        if self.disagg_threshold_tokens < 0:
            raise ValueError(f"disagg_threshold_tokens must be non-negative, got {self.disagg_threshold_tokens}")
        if self.standing_lease_tokens < 0:
            raise ValueError(f"standing_lease_tokens must be non-negative, got {self.standing_lease_tokens}")
        CacheWeights(self.cache_routing_weight, self.cache_routing_max_load)  # raises ValueError naming the bad one
        for name in ("load_poll_interval_s", "worker_timeout_s", "admission_timeout_s", "cleanup_timeout_s",
                     "standing_lease_ttl_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive")
