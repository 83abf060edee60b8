"""The gateway's Prometheus metrics (docs/metrics.md), in a registry of their own, served at GET /metrics
on the HTTP port.

GatewayMetrics is the observer a RequestRun reports to (admission, tokens, finish); the front ends (gRPC
servicer, HTTP app) count each request once more by its final status and its gRPC / HTTP code."""
from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
ACCEPT_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0, 12.0, 16.0)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter("pdserve_requests", "Finished requests by API (grpc, http), final status "
                                "(stop, length, abort, error) and gRPC status name / HTTP status code",
                                ["api", "status", "code"], registry=r)
        self.prompt_tokens = Counter("pdserve_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("pdserve_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("pdserve_time_to_first_token_seconds", "Arrival at the gateway to the first token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("pdserve_inter_token_latency_seconds", "Gap between tokens after the first (a chunk "
                             "of n tokens counts n gaps of gap / n)", buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("pdserve_e2e_request_latency_seconds", "Arrival to the last token (or the error)",
                             buckets=E2E_BUCKETS, registry=r)
        self.queue_time = Histogram("pdserve_request_queue_time_seconds", "Arrival to admission: until a decode "
                                    "worker reserved the prompt's KV pages", buckets=TTFT_BUCKETS, registry=r)
        self.prefill_time = Histogram("pdserve_request_prefill_seconds", "Admission to the prefill worker's answer "
                                      "(its queue, the prefill, the KV handoff, the two hops)", buckets=TTFT_BUCKETS,
                                      registry=r)
        self.decode_setup_time = Histogram("pdserve_request_decode_setup_seconds", "The first token's arrival to the "
                                           "first decode chunk (the Decode call, KV admission, one engine step)",
                                           buckets=TTFT_BUCKETS, registry=r)
        self.accepted_per_step = Histogram("pdserve_request_accepted_tokens_per_step", "Per request: tokens "
                                           "produced per decode (verify) step; 1 without speculation",
                                           buckets=ACCEPT_BUCKETS, registry=r)
        self.running = Gauge("pdserve_requests_running", "Admitted requests not yet finished", registry=r)
        self.waiting = Gauge("pdserve_requests_waiting", "Requests waiting for admission (decode pages)", registry=r)
        self.spares = Gauge("pdserve_standing_leases_held", "Spare decode reservations held (standing leases, "
                            "one per decode worker with room)", registry=r)
        self.migrations = Counter("pdserve_request_migrations", "Requests moved to another decode worker after "
                                  "theirs died or hung mid-stream (gateway/migration.py)", registry=r)
        self.cache_expected = Counter("pdserve_cache_routing_expected_tokens", "Prompt tokens the KV index expected "
                                      "the chosen worker's prefix cache to hold (role: decode = its leading pages, "
                                      "prefill = what its lookup maps)", ["role"], registry=r)
        self.cache_actual = Counter("pdserve_cache_routing_actual_tokens", "Prompt tokens the chosen worker reported "
                                    "cached (prefill: PrefillResponse.num_cached_tokens; decode: once Reserve reports "
                                    "it, gateway/route_note.py)", ["role"], registry=r)
        self.cache_routed_requests = Counter("pdserve_cache_routing_requests", "Requests routed, by role and whether "
                                             "the index expected a hit there", ["role", "expected_hit"], registry=r)
        self.spares_taken = Counter("pdserve_standing_leases_taken", "Requests that took a spare decode "
                                    "reservation instead of a Reserve round trip", registry=r)

    def track(self, running: Callable[[], float], waiting: Callable[[], float],
              spares: Callable[[], float] = lambda: 0) -> None:
        """The running / waiting / spares-held gauges read these at scrape time."""
        self.running.set_function(running)
        self.waiting.set_function(waiting)
        self.spares.set_function(spares)

    # --- the RequestRun observer ----------------------------------------------------------------------
    def admitted(self, queue_s: float, prompt_tokens: int, spare: bool = False) -> None:
        self.queue_time.observe(queue_s)
        self.prompt_tokens.inc(prompt_tokens)
        if spare:
            self.spares_taken.inc()

    def prefilled(self, prefill_s: float) -> None:
        self.prefill_time.observe(prefill_s)

    def decode_started(self, setup_s: float) -> None:
        self.decode_setup_time.observe(setup_s)

    def first_token(self, ttft_s: float) -> None:
        self.ttft.observe(ttft_s)

    def tokens(self, count: int, gap_s: float | None) -> None:
        """count tokens arrived gap_s after the previous ones (None: they came with the first token)."""
        self.generation_tokens.inc(count)
        if gap_s is not None and count > 0:
            for _ in range(count):
                self.itl.observe(gap_s / count)

    def finished(self, e2e_s: float, decode_steps: int, decode_tokens: int) -> None:
        self.e2e.observe(e2e_s)
        if decode_steps > 0:
            self.accepted_per_step.observe(decode_tokens / decode_steps)

    def cache_routed(self, role: str, expected: int, actual: int | None) -> None:
        self.cache_expected.labels(role).inc(expected)
        if actual is not None:
            self.cache_actual.labels(role).inc(actual)
        self.cache_routed_requests.labels(role, "yes" if expected else "no").inc()

    def count(self, api: str, status: str, code: str) -> None:
        self.requests.labels(api, status, code).inc()
