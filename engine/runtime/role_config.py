"""What a worker's role config shares: it embeds one EngineConfig and reads engine settings through it."""
from __future__ import annotations

from typing import Any

from engine.runtime.devices import serving_device
from engine.engine_config import EngineConfig


class EmbedsEngineConfig:
    """Mixin for a frozen role config with a field `engine: EngineConfig` (prefill and decode workers):
    config.tp_size is config.engine.tp_size, for every engine setting the role config does not define."""

    engine: EngineConfig

    def __getattr__(self, name: str) -> Any:  # only called when normal lookup fails
        if name == "engine" or name.startswith("__"):  # (during unpickling / copying, before `engine` is set)
            raise AttributeError(name)
        return getattr(self.engine, name)

    def engine_config(self) -> EngineConfig:
        return self.engine

    def check_addresses(self) -> None:
        """listen must be host:port; metrics_listen too when set ("" = no metrics endpoint)."""
        listen, metrics = getattr(self, "listen", ""), getattr(self, "metrics_listen", "")
        if not listen or ":" not in listen:
            raise ValueError(f"listen must be host:port, got {listen!r}")
        if metrics and ":" not in metrics:
            raise ValueError(f"metrics_listen must be host:port, got {metrics!r}")


def worker_engine_config(fields: dict[str, Any], **role: Any) -> EngineConfig:
    """The EngineConfig of a worker from its engine flags (`fields`) and what its role fixes (`role`: kv_pool,
    page_pools). Workers share weights per node unless told not to; device "auto" means the serving
    device (engine.runtime.devices.serving_device)."""
    merged = {"share_weights": True, **fields, **role}
    merged["device"] = serving_device(merged.get("device", "auto"))
    return EngineConfig(**merged)
