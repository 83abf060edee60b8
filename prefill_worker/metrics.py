"""The prefill worker's Prometheus metrics (docs/metrics.md): queue and compute time, KV transfer bytes
and seconds by transport, and the queue's size (read from the service at scrape time)."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

QUEUE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TRANSFER_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class QueueFigures(Protocol):
    """The prefill queue's size (prefill_worker.service.PrefillLoadSnapshot)."""

    queued_requests: int
    queued_tokens: int


class PrefixCacheStatsLike(Protocol):
    """The prefix cache's counters and gauges (engine.runtime.outputs.PrefixCacheStats)."""

    queried_tokens: int
    hit_tokens: int
    checkpoint_hits: int
    cached_pages: int
    evictable_pages: int
    evicted_pages: int
    checkpoints: int
    checkpoint_slots: int
    evicted_checkpoints: int

class PrefillMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.prompts = Counter("pdserve_prefill_requests", "Prompts prefilled, by outcome (ok, cancelled, error)",
                               ["status"], registry=r)
        self.queue_time = Histogram("pdserve_prefill_queue_time_seconds", "Arrival at the prefill worker to the "
                                    "start of its prefill step", buckets=QUEUE_BUCKETS, registry=r)
        self.compute_time = Histogram("pdserve_prefill_compute_seconds", "The engine's prefill of the prompt's "
                                      "batch", buckets=QUEUE_BUCKETS, registry=r)
        self.transfer_bytes = Counter("pdserve_kv_transfer_bytes", "KV bytes handed to the decode worker(s), by "
                                      "transport (shm: written in place and checksummed; grpc: pushed)",
                                      ["transport"], registry=r)
        self.transfer_time = Histogram("pdserve_kv_transfer_seconds", "Per request: KV handoff after the prefill "
                                       "(shm completion records, or the grpc push)", ["transport"],
                                       buckets=TRANSFER_BUCKETS, registry=r)
        self.borrowed_steps = Counter("pdserve_prefill_borrowed_core_steps", "Engine steps run on the decode workers' "
                                      "cores while they were idle (core lending on a CPU node, --borrow-cpus)",
                                      registry=r)
        self.queued_requests = Gauge("pdserve_prefill_queued_requests", "Prompts waiting for a prefill step", registry=r)
        self.queued_tokens = Gauge("pdserve_prefill_queued_tokens", "Prompt tokens waiting for a prefill step", registry=r)
        self.state_slots_free = Gauge("pdserve_state_slots_free", "The prefill engine's own KDA state slots free "
                                      "(0 for pure-MLA models)", registry=r)
        self.state_slots_used = Gauge("pdserve_state_slots_used", "The prefill engine's own KDA state slots in use",
                                      registry=r)
        self.checkpoints = Gauge("pdserve_state_checkpoints", "Recurrent-state checkpoints the prefix cache holds "
                                 "(0 without a prefix cache)", registry=r)
        self.checkpoint_slots = Gauge("pdserve_state_checkpoint_slots", "The prefix cache's checkpoint pool size "
                                      "(0 without a prefix cache)", registry=r)

    def track(self, load: Callable[[], QueueFigures],
              cache_stats: Callable[[], PrefixCacheStatsLike | None] | None = None) -> None:
        """load() -> the service's PrefillLoadSnapshot; cache_stats() -> the engine's PrefixCacheStats (None before
        it runs); both read at scrape time."""
        self.queued_requests.set_function(lambda: load().queued_requests)
        self.queued_tokens.set_function(lambda: load().queued_tokens)
        self.state_slots_free.set_function(lambda: load().free_state_slots)
        self.state_slots_used.set_function(lambda: load().total_state_slots - load().free_state_slots)
        self.checkpoints.set_function(lambda: load().checkpoints)
        self.checkpoint_slots.set_function(lambda: load().checkpoint_slots)
        if cache_stats is not None:
            self.registry.register(PrefixCacheCollector(cache_stats))

    def prefilled(self, queue_s: float, compute_s: float, transport: str, num_bytes: int, transfer_s: float) -> None:
        self.prompts.labels("ok").inc()
        self.queue_time.observe(queue_s)
        self.compute_time.observe(compute_s)
        self.transfer_bytes.labels(transport).inc(num_bytes)
        self.transfer_time.labels(transport).observe(transfer_s)


class PrefixCacheCollector(Collector):
    """The prefill engine's prefix cache (engine/cache/prefix_cache.py), read at scrape time: prompt tokens looked up
    and served (pages; KDA checkpoint hits apart), occupancy and evictions."""

    def __init__(self, stats: Callable[[], PrefixCacheStatsLike | None]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        if stats is None:
            return
        for name, documentation, value in (
            ("pdserve_prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache", stats.queried_tokens),
            ("pdserve_prefix_cache_hit_tokens", "Of those, served from cached pages (not computed)", stats.hit_tokens),
            ("pdserve_prefix_cache_checkpoint_hits", "Lookups that restored a KDA state checkpoint", stats.checkpoint_hits),
            ("pdserve_prefix_cache_evicted_pages", "Cached pages evicted to make room", stats.evicted_pages),
            ("pdserve_prefix_cache_evicted_checkpoints", "KDA state checkpoints evicted", stats.evicted_checkpoints),
        ):
            yield CounterMetricFamily(name, documentation, value=value)
        for name, documentation, value in (
            ("pdserve_prefix_cache_pages", "Pages the prefix cache holds (in use or not)", stats.cached_pages),
            ("pdserve_prefix_cache_evictable_pages", "Of those, unreferenced (counted as free)", stats.evictable_pages),
            ("pdserve_prefix_cache_checkpoints", "KDA state checkpoints held", stats.checkpoints),
            ("pdserve_prefix_cache_checkpoint_slots", "Size of the checkpoint pool", stats.checkpoint_slots),
        ):
            yield GaugeMetricFamily(name, documentation, value=value)
