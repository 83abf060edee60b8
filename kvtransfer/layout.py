"""KVLayout: the page geometry both ends of a KV handoff must agree on, and its stable hash."""
from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass

import torch

from engine.kv_cache import CacheShape
from kvtransfer.errors import LayoutMismatch

# The dtypes a pool may hold, by their torch name without the "torch." prefix.
DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e4m3fnuz": torch.float8_e4m3fnuz,
    "uint8": torch.uint8,
}
HASH_VERSION = "pdserve-kv-layout-v1"


class SegmentKind(enum.IntEnum):
    """Which page tensor: the target model's latent pages or the draft model's context pages."""

    TARGET = 0
    DRAFT = 1


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"unsupported KV dtype {dtype}; supported: {sorted(DTYPES)}")
    return name


@dataclass(frozen=True)
class KVLayout:
    """Geometry of one TP rank's page pool, independent of how many pages it has.

    target pages: [num_layers, num_pages, page_size, latent_dim + rope_dim]
    draft pages:  [draft_layers, num_pages, page_size, draft_dim]
    """

    num_layers: int
    latent_dim: int
    rope_dim: int
    page_size: int
    dtype: str = "bfloat16"
    draft_layers: int = 0
    draft_dim: int = 0

    def __post_init__(self) -> None:
        for name in ("num_layers", "latent_dim", "page_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVLayout.{name} must be positive, got {getattr(self, name)}")
        if self.rope_dim < 0 or self.draft_layers < 0 or self.draft_dim < 0:
            raise ValueError("KVLayout dims must be non-negative")
        if (self.draft_layers == 0) != (self.draft_dim == 0):
            raise ValueError("KVLayout: draft_layers and draft_dim must both be zero or both positive")
        if self.dtype not in DTYPES:
            raise ValueError(f"KVLayout.dtype {self.dtype!r} is not one of {sorted(DTYPES)}")

    # --- conversions ----------------------------------------------------------------------------------
    @classmethod
    def from_cache_shape(cls, shape: CacheShape) -> KVLayout:
        return cls(
            num_layers=shape.num_layers,
            latent_dim=shape.latent_dim,
            rope_dim=shape.rope_dim,
            page_size=shape.page_size,
            dtype=dtype_name(shape.dtype),
            draft_layers=shape.draft_layers,
            draft_dim=shape.draft_dim if shape.draft_layers else 0,
        )

    def to_cache_shape(self, num_pages: int) -> CacheShape:
        return CacheShape(
            num_layers=self.num_layers,
            num_pages=num_pages,
            page_size=self.page_size,
            latent_dim=self.latent_dim,
            rope_dim=self.rope_dim,
            dtype=self.torch_dtype,
            draft_layers=self.draft_layers,
            draft_dim=self.draft_dim,
        )

    def to_proto(self):
        from rpc.internal.v1 import kv_pb2

        return kv_pb2.KVLayout(
            num_layers=self.num_layers, latent_dim=self.latent_dim, rope_dim=self.rope_dim,
            page_size=self.page_size, dtype=self.dtype, draft_layers=self.draft_layers,
            draft_dim=self.draft_dim, hash=self.hash,
        )

    @classmethod
    def from_proto(cls, message) -> KVLayout:
        layout = cls(
            num_layers=message.num_layers, latent_dim=message.latent_dim, rope_dim=message.rope_dim,
            page_size=message.page_size, dtype=message.dtype, draft_layers=message.draft_layers,
            draft_dim=message.draft_dim,
        )
        check_layout(layout, message.hash or layout.hash, "KVLayout message")
        return layout

    # --- identity -------------------------------------------------------------------------------------
    @property
    def canonical(self) -> str:
        """The text the hash is taken over: fixed field order, decimal integers, the dtype's torch name."""
        return (
            f"{HASH_VERSION}|num_layers={self.num_layers}|latent_dim={self.latent_dim}|rope_dim={self.rope_dim}"
            f"|page_size={self.page_size}|dtype={self.dtype}|draft_layers={self.draft_layers}"
            f"|draft_dim={self.draft_dim}"
        )

    @property
    def hash(self) -> str:
        """First 16 hex digits of sha256(canonical): the same in every process, run and machine."""
        return hashlib.sha256(self.canonical.encode("ascii")).hexdigest()[:16]

    # --- derived sizes --------------------------------------------------------------------------------
    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def element_size(self) -> int:
        return self.torch_dtype.itemsize

    @property
    def entry_dim(self) -> int:
        return self.latent_dim + self.rope_dim

    def segments(self) -> list[tuple[SegmentKind, int]]:
        """(kind, layer) of every page tensor in layer-major transfer order: target layers, then draft layers."""
        return [(SegmentKind.TARGET, layer) for layer in range(self.num_layers)] + [
            (SegmentKind.DRAFT, layer) for layer in range(self.draft_layers)
        ]

    def num_segment_layers(self, kind: SegmentKind) -> int:
        return self.num_layers if kind == SegmentKind.TARGET else self.draft_layers

    def row_dim(self, kind: SegmentKind) -> int:
        return self.entry_dim if kind == SegmentKind.TARGET else self.draft_dim

    def page_bytes(self, kind: SegmentKind) -> int:
        """Bytes of one page of one layer of the given kind."""
        return self.page_size * self.row_dim(kind) * self.element_size

    @property
    def bytes_per_page(self) -> int:
        """Bytes of one page over every layer, target and draft."""
        return self.num_layers * self.page_bytes(SegmentKind.TARGET) + self.draft_layers * self.page_bytes(
            SegmentKind.DRAFT
        )

    def pool_bytes(self, num_pages: int) -> int:
        return num_pages * self.bytes_per_page

    def pages_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)


def check_layout(expected: KVLayout, got_hash: str, where: str) -> None:
    """Raises LayoutMismatch unless got_hash is expected's hash."""
    if got_hash != expected.hash:
        raise LayoutMismatch(
            f"KV layout mismatch at {where}: expected {expected.hash} ({expected.canonical}), got {got_hash or '<none>'}"
        )
