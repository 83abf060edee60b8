"""GPU catalog: memory per GPU and an editable $/GPU-hour for each accelerator the planner knows."""
from __future__ import annotations

from dataclasses import dataclass, replace

GB = 10**9  # capacities are the vendors' marketed figures in decimal GB


@dataclass(frozen=True)
class GpuSpec:
    """One accelerator. price_source says where the $/GPU-hour comes from: the seed deployment's
    figures, an assumption (a rough on-demand cloud rate; override it with --gpu-price) or the user."""

    name: str
    memory_gb: float
    price_per_hour: float
    price_source: str
    vendor: str = ""

    def __post_init__(self) -> None:
        if not self.memory_gb > 0:
            raise ValueError(f"GPU memory must be positive, got {self.memory_gb} GB")
        if not self.price_per_hour > 0:
            raise ValueError(f"GPU price must be positive, got ${self.price_per_hour}/hour")

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gb * GB)


SEED = "seed deployment"
ASSUMED = "assumption: rough on-demand cloud rate, pass --gpu-price"

CATALOG: dict[str, GpuSpec] = {
    spec.name: spec
    for spec in (
        GpuSpec("MI355X", 288, 2.50, SEED, "AMD"),
        GpuSpec("MI300X", 192, 1.90, ASSUMED, "AMD"),
        GpuSpec("B200", 192, 4.25, SEED, "NVIDIA"),
        GpuSpec("B300", 288, 6.00, SEED, "NVIDIA"),
        GpuSpec("H200", 141, 3.20, ASSUMED, "NVIDIA"),
        GpuSpec("H100", 80, 2.20, ASSUMED, "NVIDIA"),
    )
}


def lookup_gpu(name: str, memory_gb: float | None = None, price: float | None = None) -> GpuSpec:
    """A catalog GPU (case-insensitive), with memory and price overridden when given. A name not
    in the catalog is accepted only with both memory_gb and price (a custom GPU)."""
    for spec in CATALOG.values():
        if spec.name.lower() == name.strip().lower():
            changes: dict[str, object] = {}
            if memory_gb is not None:
                changes["memory_gb"] = memory_gb
            if price is not None:
                changes.update(price_per_hour=price, price_source="given")
            return replace(spec, **changes)
    if memory_gb is not None and price is not None:
        return GpuSpec(name.strip(), memory_gb, price, "given", "custom")
    known = ", ".join(CATALOG)
    raise ValueError(f"unknown GPU {name!r} (known: {known}; for another GPU give --gpu-memory-gb and --gpu-price)")
