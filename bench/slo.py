"""Service-level objective for goodput: per-request latency bounds in milliseconds."""
from __future__ import annotations

import math
from dataclasses import dataclass

from bench.record import RequestRecord

SLO_KEYS = ("ttft_ms", "tpot_ms", "e2e_ms")


@dataclass(frozen=True)
class SLO:
    """A request is good when it meets every bound that is set (None = no bound).
    A request with fewer than two output tokens has no TPOT and meets any TPOT bound."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    def __post_init__(self) -> None:
        for key in SLO_KEYS:
            value = getattr(self, key)
            if value is not None and (not math.isfinite(value) or value <= 0):
                raise ValueError(f"SLO bound {key} must be a positive number of milliseconds, got {value!r}")

    @property
    def bounds(self) -> dict[str, float]:
        return {key: getattr(self, key) for key in SLO_KEYS if getattr(self, key) is not None}

    @classmethod
    def parse(cls, text: str) -> SLO:
        """'ttft_ms=200,tpot_ms=50' -> SLO(ttft_ms=200.0, tpot_ms=50.0). Unknown keys are an error."""
        values: dict[str, float] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, sep, raw = item.partition("=")
            key = key.strip()
            if not sep or key not in SLO_KEYS:
                raise ValueError(f"bad SLO item {item!r}: expected one of {', '.join(SLO_KEYS)} as key=milliseconds")
            if key in values:
                raise ValueError(f"SLO key {key} given twice")
            try:
                values[key] = float(raw)
            except ValueError:
                raise ValueError(f"bad SLO value for {key}: {raw.strip()!r} is not a number") from None
        if not values:
            raise ValueError("empty SLO: give e.g. ttft_ms=200,tpot_ms=50")
        return cls(**values)

    def met_by(self, record: RequestRecord) -> bool:
        if not record.success:
            return False
        if self.ttft_ms is not None and record.ttft_s * 1000 > self.ttft_ms:
            return False
        tpot = record.tpot_s
        if self.tpot_ms is not None and tpot is not None and tpot * 1000 > self.tpot_ms:
            return False
        return self.e2e_ms is None or record.e2e_s * 1000 <= self.e2e_ms
