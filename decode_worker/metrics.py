"""The decode worker's Prometheus metrics (docs/metrics.md), read from the service and its engine at
scrape time: nothing is added to the engine step."""
from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from decode_worker.service import DecodeService


class DecodeCollector(Collector):
    """service: a DecodeService (its load snapshot, lease expiries, engine and engine port)."""

    def __init__(self, service: DecodeService) -> None:
        self._service = service

    def collect(self) -> Iterator[Metric]:
        load = self._service.load
        gauges = (
            ("pdserve_kv_pages_free", "KV cache pages free in the decode pool", load.free_pages),
            ("pdserve_kv_pages_used", "KV cache pages in use (running requests and leases)", load.total_pages - load.free_pages),
            ("pdserve_kv_pages_leased", "Pages held by leases not yet claimed by a Decode call", load.leased_pages),
            ("pdserve_kv_pages_standing", "Of the leased pages, those held by standing leases (gateways' spares)",
             load.standing_pages),
            ("pdserve_standing_leases", "Unclaimed standing leases (gateways' spares)", load.standing_leases),
            ("pdserve_decode_requests_running", "Requests decoding in the engine", load.running),
            ("pdserve_decode_requests_waiting", "Requests the engine holds but does not run (e.g. preempted)", load.waiting),
            ("pdserve_state_slots_free", "Linear-attention (KDA) state slots free (0 for pure-MLA models)",
             load.free_state_slots),
            ("pdserve_state_slots_used", "KDA state slots in use (running requests and leases)",
             load.total_state_slots - load.free_state_slots),
            ("pdserve_state_checkpoints", "Recurrent-state checkpoints the prefix cache holds (0 without a prefix "
             "cache)", load.checkpoints),
            ("pdserve_state_checkpoint_slots", "The prefix cache's checkpoint pool size (0 without a prefix cache)",
             load.checkpoint_slots),
            ("pdserve_prefix_cache_pages", "Pages the prefix cache holds (in use or not)", load.cached_pages),
        )
        for name, documentation, value in gauges:
            yield GaugeMetricFamily(name, documentation, value=value)
        engine = self._service.engine
        stats = getattr(engine, "acceptance_stats", None)
        counters = [
            ("pdserve_decode_reservations", "Requests admitted: reservations granted, standing leases once claimed",
             load.requests_total),
            ("pdserve_lease_expiries", "Leases freed because no Decode call claimed them in time",
             self._service.lease_expiries),
            ("pdserve_decode_cached_tokens", "Prompt tokens reservations found in this worker's prefix cache (their "
             "pages held by the lease, not written again by prefill)", self._service.book_figure("cached_tokens")),
            ("pdserve_decode_local_prefills", "Requests prefilled on this decode worker itself (no prefill hop)",
             self._service.book_figure("local_prefills")),
            ("pdserve_preemptions", "Running requests preempted for lack of pages (recomputed later)",
             getattr(engine, "num_preemptions", 0)),
            ("pdserve_decode_engine_steps", "Engine steps that produced tokens", self._service.port.engine_steps),
            ("pdserve_decode_engine_step_tokens", "Tokens those steps produced (per step: the batch's tokens)",
             self._service.port.engine_step_tokens),
            ("pdserve_decode_borrowed_core_steps", "Engine steps run on the prefill workers' cores while they were "
             "idle (core lending on a CPU node, --core-board)", getattr(engine, "borrowed_steps", 0)),
            ("pdserve_prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache",
             load.prefix_queried_tokens),
            ("pdserve_prefix_cache_hit_tokens", "Of those, served from cached pages (not computed)",
             load.prefix_hit_tokens),
        ]
        if stats is not None:
            counters += [
                ("pdserve_spec_verify_steps", "Speculative verify steps (one sequence verified once)", stats.num_verify_steps),
                ("pdserve_spec_draft_tokens", "Draft tokens proposed for verification", stats.num_drafts),
                ("pdserve_spec_accepted_draft_tokens", "Draft tokens accepted; tokens per verify step = "
                 "1 + accepted / verify steps", stats.num_accepted_drafts),
            ]
        for name, documentation, value in counters:
            yield CounterMetricFamily(name, documentation, value=value)


def decode_registry(service: DecodeService) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(DecodeCollector(service))
    return registry
