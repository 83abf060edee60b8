"""KVLayout: the page geometry both ends of a KV handoff must agree on, and its stable hash."""
from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from engine.model_configs.base import check_positive
from engine.cache.kv_cache import CacheShape
from engine.cache.state_pool import SLOT_ALIGN, StateShape
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
# The fields KVLayout and engine.cache.kv_cache.CacheShape share, by the same names.
_GEOMETRY = ("num_layers", "latent_dim", "rope_dim", "page_size", "draft_layers", "draft_dim")


def _values(source: object, names: Iterable[str]) -> dict[str, int]:
    return {name: getattr(source, name) for name in names}


class SegmentKind(enum.IntEnum):
    """Which part of a pool: the target model's latent pages, the draft model's context pages, or the
    linear-attention state slots (one "page" of that kind = one slot, every KDA layer; layer 0 only)."""

    TARGET = 0
    DRAFT = 1
    STATE = 2


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"unsupported KV dtype {dtype}; supported: {sorted(DTYPES)}")
    return name


@dataclass(frozen=True)
class StateLayout:
    """One linear-attention state slot on one rank: every KDA layer's conv [conv_width, conv_channels]
    conv_dtype, then recurrent [state_heads, head_k_dim, head_v_dim] ssm_dtype (engine/cache/state_pool.py's
    slot-major row). The field names are kv_pb2.KVLayout's."""

    state_layers: int
    conv_width: int
    conv_channels: int
    state_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_dtype: str
    ssm_dtype: str

    def __post_init__(self) -> None:
        check_positive(self, _STATE_INTS, "StateLayout.")
        for name in ("conv_dtype", "ssm_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"StateLayout.{name} {getattr(self, name)!r} is not one of {sorted(DTYPES)}")

    @classmethod
    def from_shape(cls, state: StateShape) -> StateLayout:
        return cls(state.num_kda_layers, state.conv_width, state.conv_channels, state.num_heads, state.head_k_dim,
                   state.head_v_dim, dtype_name(state.conv_dtype), dtype_name(state.ssm_dtype))

    def to_shape(self, num_slots: int) -> StateShape:
        return StateShape(self.state_layers, num_slots, self.conv_width, self.conv_channels, self.state_heads,
                          self.head_k_dim, self.head_v_dim, DTYPES[self.conv_dtype], DTYPES[self.ssm_dtype])


_STATE_FIELDS = tuple(field.name for field in dataclasses.fields(StateLayout))
_STATE_INTS = _STATE_FIELDS[:6]


@dataclass(frozen=True)
class KVLayout:
    """Geometry of one TP rank's page pool, independent of how many pages it has.

    target pages: [num_layers, num_pages, page_size, latent_dim + rope_dim]
    draft pages:  [draft_layers, num_pages, page_size, draft_dim]
    state slots:  models with linear attention (state not None), after the pages
    """

    num_layers: int  # MLA layers whose latents the pages hold (K3: the MLA layers only, not the KDA ones)
    latent_dim: int  # compressed KV width, kv_lora_rank (512 in DeepSeek-V3)
    rope_dim: int  # decoupled RoPE key width, qk_rope_head_dim (64 in DeepSeek-V3)
    page_size: int  # tokens per page
    dtype: str = "bfloat16"  # torch dtype name of the page elements
    draft_layers: int = 0  # draft-model layers sharing each page (0: no draft context)
    draft_dim: int = 0  # width of one draft-context entry per token and draft layer
    state: StateLayout | None = None  # recurrent-state slots of linear-attention layers (K3), else None

    def __post_init__(self) -> None:
        check_positive(self, ("num_layers", "latent_dim", "page_size"), "KVLayout.")
        if self.rope_dim < 0 or self.draft_layers < 0 or self.draft_dim < 0:
            raise ValueError("KVLayout dims must be non-negative")
        if (self.draft_layers == 0) != (self.draft_dim == 0):
            raise ValueError("KVLayout: draft_layers and draft_dim must both be zero or both positive")
        if self.dtype not in DTYPES:
            raise ValueError(f"KVLayout.dtype {self.dtype!r} is not one of {sorted(DTYPES)}")

    # --- conversions ----------------------------------------------------------------------------------
    @classmethod
    def from_cache_shape(cls, shape: CacheShape) -> KVLayout:
        state = None if shape.state is None else StateLayout.from_shape(shape.state)
        geometry = _values(shape, _GEOMETRY) | {"draft_dim": shape.draft_dim if shape.draft_layers else 0}
        return cls(dtype=dtype_name(shape.dtype), **geometry, state=state)

    @property
    def has_state(self) -> bool:
        return self.state is not None

    def state_shape(self, num_slots: int) -> StateShape | None:
        """The state pool geometry of num_slots slots (None without state)."""
        return None if self.state is None else self.state.to_shape(num_slots)

    def to_cache_shape(self, num_pages: int, num_slots: int = 0) -> CacheShape:
        """num_slots: state slots (a layout with state needs at least one)."""
        if self.has_state and num_slots <= 0:
            raise ValueError("a KV layout with linear-attention state needs num_slots > 0")
        return CacheShape(num_pages=num_pages, dtype=self.torch_dtype, state=self.state_shape(num_slots),
                          **_values(self, _GEOMETRY))

    def to_proto(self):
        from rpc.internal.v1 import kv_pb2

        return kv_pb2.KVLayout(hash=self.hash, **_values(self, _PAGE_FIELDS), **self._state_fields())

    def _state_fields(self) -> dict[str, int]:
        """The state's fields by kv_pb2.KVLayout's names (none without state)."""
        return {} if self.state is None else _values(self.state, _STATE_FIELDS)

    @classmethod
    def from_proto(cls, message) -> KVLayout:
        """The kv_pb2.KVLayout message's fields (same names; state_layers 0: no state), checked against the
        hash it carries."""
        state_fields = _values(message, _STATE_FIELDS)
        if not message.state_layers and any(state_fields.values()):
            raise ValueError("KVLayout: state fields must all be zero / empty when state_layers is 0")
        state = StateLayout(**state_fields) if message.state_layers else None
        layout = cls(**_values(message, _PAGE_FIELDS), state=state)
        check_layout(layout, message.hash or layout.hash, "KVLayout message")
        return layout

    # --- identity -------------------------------------------------------------------------------------
    @property
    def canonical(self) -> str:
        """The text the hash is taken over: fixed field order, decimal integers, the dtype's torch name."""
        text = (
            f"{HASH_VERSION}|num_layers={self.num_layers}|latent_dim={self.latent_dim}|rope_dim={self.rope_dim}"
            f"|page_size={self.page_size}|dtype={self.dtype}|draft_layers={self.draft_layers}"
            f"|draft_dim={self.draft_dim}"
        )
        if self.has_state:  # (pure-MLA layouts keep the text, and so the hash, they always had)
            text += "".join(f"|{name}={value}" for name, value in self._state_fields().items())
        return text

    @functools.cached_property
    def hash(self) -> str:
        """First 16 hex digits of sha256(canonical): the same in every process, run and machine (taken once
        per layout object: every KV writer and reader compares it per request)."""
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
        """(kind, layer) of every page tensor in layer-major transfer order: target layers, then draft
        layers, then (with state) the state slot as one segment (STATE, 0)."""
        return [(SegmentKind.TARGET, layer) for layer in range(self.num_layers)] + [
            (SegmentKind.DRAFT, layer) for layer in range(self.draft_layers)
        ] + ([(SegmentKind.STATE, 0)] if self.has_state else [])

    def num_segment_layers(self, kind: SegmentKind) -> int:
        if kind == SegmentKind.STATE:
            return 1 if self.has_state else 0
        return self.num_layers if kind == SegmentKind.TARGET else self.draft_layers

    def row_dim(self, kind: SegmentKind) -> int:
        if kind == SegmentKind.STATE:
            raise ValueError("state slots have no row dimension (see state_bytes)")
        return self.entry_dim if kind == SegmentKind.TARGET else self.draft_dim

    @property
    def state_bytes(self) -> int:
        """Bytes of one state slot on one rank, its alignment padding included (0 without state)."""
        shape = self.state_shape(1)
        return shape.slot_stride if shape is not None else 0

    def page_bytes(self, kind: SegmentKind) -> int:
        """Bytes of one page of one layer of the given kind (STATE: one whole slot)."""
        if kind == SegmentKind.STATE:
            return self.state_bytes
        return self.page_size * self.row_dim(kind) * self.element_size

    @property
    def bytes_per_page(self) -> int:
        """Bytes of one page over every layer, target and draft."""
        return self.num_layers * self.page_bytes(SegmentKind.TARGET) + self.draft_layers * self.page_bytes(
            SegmentKind.DRAFT
        )

    def request_bytes(self, num_pages: int) -> int:
        """Bytes one request moves per rank: its pages and (with state) its state slot."""
        return num_pages * self.bytes_per_page + self.state_bytes

    def state_offset(self, num_pages: int) -> int:
        """Byte offset of state slot 0 in a pool of num_pages pages (CacheShape.state_offset)."""
        return -(-self.pool_bytes(num_pages) // SLOT_ALIGN) * SLOT_ALIGN

    def pool_bytes(self, num_pages: int, num_slots: int = 0) -> int:
        """Bytes of a pool's flat buffer: num_pages pages and, with state, num_slots slots after them."""
        pages = num_pages * self.bytes_per_page
        return self.state_offset(num_pages) + num_slots * self.state_bytes if self.has_state and num_slots else pages

    def pages_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)


_PAGE_FIELDS = tuple(field.name for field in dataclasses.fields(KVLayout) if field.name != "state")  # kv_pb2's names


def check_layout(expected: KVLayout, got_hash: str, where: str) -> None:
    """Raises LayoutMismatch unless got_hash is expected's hash."""
    if got_hash != expected.hash:
        raise LayoutMismatch(
            f"KV layout mismatch at {where}: expected {expected.hash} ({expected.canonical}), got {got_hash or '<none>'}"
        )
