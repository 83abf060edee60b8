"""The workers' metrics read what their services know: the decode collector exports pages, requests,
lease expiries, preemptions and speculative counters from a service snapshot; the prefill metrics count a
prefilled prompt with its transfer bytes by transport."""
from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from decode_worker.metrics import decode_registry
from decode_worker.service import LoadSnapshot
from prefill_worker.config import PrefillWorkerConfig
from prefill_worker.metrics import PrefillMetrics
from prefill_worker.service import PrefillService
from rpc.convert import load_to_proto
from rpc.internal.v1 import worker_pb2


@dataclass
class _Stats:
    num_verify_steps: int = 10
    num_drafts: int = 70
    num_accepted_drafts: int = 25


@dataclass
class _Engine:
    acceptance_stats: _Stats = field(default_factory=_Stats)
    num_preemptions: int = 2


@dataclass
class _Port:
    engine_steps: int = 6
    engine_step_tokens: int = 40


@dataclass
class _DecodeService:
    load: LoadSnapshot
    engine: _Engine = field(default_factory=_Engine)
    lease_expiries: int = 1
    port: _Port = field(default_factory=_Port)

    def book_figure(self, name: str) -> int:
        return {"cached_tokens": 48, "local_prefills": 2}[name]


def _samples(registry) -> dict[tuple[str, tuple], float]:
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_decode_collector_reads_the_service():
    """Used = total - free (pages and KDA state slots); the standing part of the leases as reported; counters
    come straight from the engine and the lease sweeper."""
    load = LoadSnapshot(free_pages=90, total_pages=128, running=3, waiting=1, leases=2, leased_pages=4, requests_total=7,
                        free_state_slots=5, total_state_slots=9, standing_leases=1, standing_pages=3, checkpoints=2,
                        checkpoint_slots=6, cached_pages=11, prefix_queried_tokens=300, prefix_hit_tokens=128)
    samples = _samples(decode_registry(_DecodeService(load)))
    assert samples[("pdserve_kv_pages_free", ())] == 90 and samples[("pdserve_kv_pages_used", ())] == 38
    assert samples[("pdserve_state_slots_free", ())] == 5 and samples[("pdserve_state_slots_used", ())] == 4
    assert samples[("pdserve_state_checkpoints", ())] == 2 and samples[("pdserve_state_checkpoint_slots", ())] == 6
    assert samples[("pdserve_decode_requests_running", ())] == 3 and samples[("pdserve_decode_requests_waiting", ())] == 1
    assert samples[("pdserve_decode_reservations_total", ())] == 7
    assert samples[("pdserve_kv_pages_standing", ())] == 3 and samples[("pdserve_standing_leases", ())] == 1
    assert samples[("pdserve_lease_expiries_total", ())] == 1 and samples[("pdserve_preemptions_total", ())] == 2
    assert samples[("pdserve_spec_verify_steps_total", ())] == 10
    assert samples[("pdserve_spec_accepted_draft_tokens_total", ())] == 25
    assert samples[("pdserve_decode_engine_steps_total", ())] == 6
    assert samples[("pdserve_decode_cached_tokens_total", ())] == 48
    assert samples[("pdserve_decode_local_prefills_total", ())] == 2
    assert samples[("pdserve_decode_engine_step_tokens_total", ())] == 40
    assert samples[("pdserve_prefix_cache_pages", ())] == 11
    assert samples[("pdserve_prefix_cache_queried_tokens_total", ())] == 300
    assert samples[("pdserve_prefix_cache_hit_tokens_total", ())] == 128


def test_prefill_metrics_count_transfers_by_transport():
    """One prefilled prompt: a count, its queue time, its bytes under its transport."""
    metrics = PrefillMetrics()
    metrics.prefilled(0.002, 0.01, "grpc", 4096, 0.003)
    samples = _samples(metrics.registry)
    assert samples[("pdserve_prefill_requests_total", (("status", "ok"),))] == 1
    assert samples[("pdserve_kv_transfer_bytes_total", (("transport", "grpc"),))] == 4096
    assert samples[("pdserve_kv_transfer_seconds_count", (("transport", "grpc"),))] == 1
    assert samples[("pdserve_prefill_queue_time_seconds_count", ())] == 1


def test_prefill_metrics_read_the_prefix_cache_at_scrape_time():
    """The prefix cache's counters and gauges come from the engine's PrefixCacheStats when scraped (none before
    the engine runs)."""
    from engine.runtime.outputs import PrefixCacheStats

    current: list[PrefixCacheStats | None] = [None]
    metrics = PrefillMetrics()
    metrics.track(lambda: SimpleNamespace(queued_requests=0, queued_tokens=0, free_state_slots=0, total_state_slots=0,
                                         checkpoints=0, checkpoint_slots=0), lambda: current[0])
    assert not any(name.startswith("pdserve_prefix_cache") for name, _ in _samples(metrics.registry))
    current[0] = PrefixCacheStats(queried_tokens=3000, hit_tokens=1408, checkpoint_hits=1, cached_pages=180,
                                  evictable_pages=170, evicted_pages=5, checkpoints=12, checkpoint_slots=64,
                                  evicted_checkpoints=2)
    samples = _samples(metrics.registry)
    assert samples[("pdserve_prefix_cache_queried_tokens_total", ())] == 3000
    assert samples[("pdserve_prefix_cache_hit_tokens_total", ())] == 1408
    assert samples[("pdserve_prefix_cache_checkpoint_hits_total", ())] == 1
    assert samples[("pdserve_prefix_cache_evicted_pages_total", ())] == 5
    assert samples[("pdserve_prefix_cache_pages", ())] == 180 and samples[("pdserve_prefix_cache_evictable_pages", ())] == 170
    assert samples[("pdserve_prefix_cache_checkpoints", ())] == 12
    assert samples[("pdserve_prefix_cache_checkpoint_slots", ())] == 64


def test_prefill_load_reports_the_engines_state_slots_and_checkpoints():
    """The prefill service's load snapshot carries its engine's own free / total KDA state slots (0 before the
    engine exists), the GetPrefillLoad message has those fields, and the gauges read them at scrape time."""
    config = PrefillWorkerConfig.build(listen="127.0.0.1:0")
    service = PrefillService(config, engine_factory=lambda: None)
    assert (service.load.free_state_slots, service.load.total_state_slots) == (0, 0)
    service.engine = SimpleNamespace(num_free_state_slots=3, num_state_slots=5)
    load = service.load
    assert (load.free_state_slots, load.total_state_slots, load.checkpoints, load.checkpoint_slots) == (3, 5, 0, 0)
    message = load_to_proto(worker_pb2.GetPrefillLoadResponse, load)
    assert (message.free_state_slots, message.total_state_slots, message.checkpoints, message.checkpoint_slots) == (
        3, 5, 0, 0)
    metrics = PrefillMetrics()
    metrics.track(lambda: service.load)
    samples = _samples(metrics.registry)
    assert samples[("pdserve_state_slots_free", ())] == 3 and samples[("pdserve_state_slots_used", ())] == 2
    assert samples[("pdserve_state_checkpoints", ())] == 0 and samples[("pdserve_state_checkpoint_slots", ())] == 0
