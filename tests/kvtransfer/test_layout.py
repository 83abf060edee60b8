"""KVLayout: CacheShape round trip, a hash that is stable across processes and sensitive to every field."""
from __future__ import annotations

import dataclasses
import pathlib
import subprocess
import sys

import pytest
import torch

from engine.cache.kv_cache import CacheShape
from kvtransfer.errors import LayoutMismatch
from kvtransfer.layout import KVLayout, SegmentKind, check_layout

from .conftest import DEEPSEEK_V3, SMALL_WITH_DRAFT


def test_cache_shape_round_trip_keeps_geometry():
    """from_cache_shape(to_cache_shape(n)) is the identity and sizes agree with CacheShape's."""
    for layout in (DEEPSEEK_V3, SMALL_WITH_DRAFT):
        shape = layout.to_cache_shape(7)
        assert KVLayout.from_cache_shape(shape) == layout
        assert layout.bytes_per_page == shape.bytes_per_page
        assert layout.pool_bytes(7) == (shape.target_numel + shape.draft_numel) * layout.element_size


def test_deepseek_v3_page_bytes():
    """61 layers x 576 bf16 values x 64 tokens per page: 68.6 KiB per token over all layers."""
    assert DEEPSEEK_V3.page_bytes(SegmentKind.TARGET) == 64 * 576 * 2
    assert DEEPSEEK_V3.bytes_per_page // 64 == 61 * 576 * 2


@pytest.mark.slow  # a child interpreter that imports kvtransfer (torch): ~2 s of CPU
def test_hash_is_stable_across_processes():
    """A fresh interpreter computes the same hash (no dependence on PYTHONHASHSEED or process state)."""
    code = ("from kvtransfer.layout import KVLayout;"
            "print(KVLayout(61, 512, 64, 64, 'bfloat16').hash)")
    root = pathlib.Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root,
                            env={"PYTHONHASHSEED": "12345", "PATH": "", "PYTHONPATH": str(root)})
    assert result.stdout.strip() == DEEPSEEK_V3.hash
    assert len(DEEPSEEK_V3.hash) == 16 and int(DEEPSEEK_V3.hash, 16) >= 0


@pytest.mark.parametrize("field,value", [
    ("num_layers", 60), ("latent_dim", 256), ("rope_dim", 32), ("page_size", 32), ("dtype", "float16"),
    ("draft_layers", 1), ("draft_dim", 64),
])
def test_hash_changes_with_every_field(field, value):
    """Changing any field changes the hash, and check_layout refuses the other one with a clear message."""
    other = dataclasses.replace(SMALL_WITH_DRAFT, **{field: value})
    assert other.hash != SMALL_WITH_DRAFT.hash
    with pytest.raises(LayoutMismatch, match=field):
        check_layout(SMALL_WITH_DRAFT, other.hash, "test")
    check_layout(other, other.hash, "test")


def test_invalid_layouts_are_rejected():
    """Non-positive sizes, unknown dtypes and half-specified draft dims raise ValueError."""
    with pytest.raises(ValueError):
        KVLayout(0, 512, 64, 64)
    with pytest.raises(ValueError):
        KVLayout(61, 512, 64, 64, dtype="int7")
    with pytest.raises(ValueError):
        KVLayout(61, 512, 64, 64, draft_layers=2, draft_dim=0)


def test_from_cache_shape_without_draft_ignores_draft_dim():
    """A CacheShape with draft_layers == 0 maps to a layout with no draft dims at all."""
    shape = CacheShape(2, 4, 8, 16, 4, torch.float32, draft_layers=0, draft_dim=99)
    layout = KVLayout.from_cache_shape(shape)
    assert (layout.draft_layers, layout.draft_dim, layout.dtype) == (0, 0, "float32")


def test_layout_proto_round_trip():
    """to_proto / from_proto keep every field; a message whose hash disagrees with its fields is refused."""
    message = SMALL_WITH_DRAFT.to_proto()
    assert KVLayout.from_proto(message) == SMALL_WITH_DRAFT
    message.hash = DEEPSEEK_V3.hash
    with pytest.raises(LayoutMismatch):
        KVLayout.from_proto(message)
