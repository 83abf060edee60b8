"""Where a request was routed and the cache overlap the gateway expected there (its KV index, gateway/kv_index.py),
beside what the workers then reported: for the request's log line and the routing metrics (gateway/metrics.py)."""
from __future__ import annotations

from dataclasses import dataclass

from rpc.internal.v1 import kv_pb2


def decode_cached_tokens(destination: kv_pb2.KVDestination) -> int | None:
    """The prompt tokens the decode worker's Reserve says it holds already (decode-side reuse: the destination's
    cached_tokens); what the `decode` role of pdserve_cache_routing_actual_tokens counts."""
    return destination.cached_tokens


@dataclass
class RouteNote:
    """expected_*: prompt tokens the index said the chosen worker's cache holds (decode: its leading pages;
    prefill: what its engine's lookup maps); actual_*: what the worker reported (None: not known)."""

    decode: str = ""
    expected_decode: int = 0
    actual_decode: int | None = None
    prefill: str = ""
    expected_prefill: int = 0
    actual_prefill: int | None = None

    def describe(self) -> str:
        """The log line's part: `decode A (expected 96 cached), prefill B (expected 96, got 96)`."""
        def got(value: int | None) -> str:
            return "" if value is None else f", got {value}"

        return (f"decode {self.decode or '-'} (expected {self.expected_decode} cached{got(self.actual_decode)}), "
                f"prefill {self.prefill or '-'} (expected {self.expected_prefill}{got(self.actual_prefill)})")
