"""Byte arithmetic over a flat page buffer: where a (kind, layer, page) lives, and a request's spans in order."""
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from engine.kv_cache import PagedLatentCache
from kvtransfer.layout import KVLayout, SegmentKind


class Span(NamedTuple):
    """Consecutive pool pages of one layer: bytes [offset, offset + nbytes) of the flat buffer."""

    kind: SegmentKind
    layer: int
    first_index: int  # position of the first page in the request's page list
    first_page: int  # pool page id
    num_pages: int
    offset: int
    nbytes: int


def page_runs(page_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """(first index in page_ids, first page id, count) for each run of consecutive ids, in order."""
    runs: list[tuple[int, int, int]] = []
    for index, page in enumerate(page_ids):
        if runs and runs[-1][1] + runs[-1][2] == page:
            first_index, first_page, count = runs[-1]
            runs[-1] = (first_index, first_page, count + 1)
        else:
            runs.append((index, page, 1))
    return runs


def segment_offset(layout: KVLayout, num_pages: int, kind: SegmentKind, layer: int) -> int:
    """Byte offset of page 0 of (kind, layer) in a pool of num_pages pages (target block, then draft block)."""
    if not 0 <= layer < layout.num_segment_layers(kind):
        raise ValueError(f"{kind.name.lower()} layer {layer} out of range")
    if kind == SegmentKind.TARGET:
        return layer * num_pages * layout.page_bytes(SegmentKind.TARGET)
    target_block = layout.num_layers * num_pages * layout.page_bytes(SegmentKind.TARGET)
    return target_block + layer * num_pages * layout.page_bytes(SegmentKind.DRAFT)


def page_offset(layout: KVLayout, num_pages: int, kind: SegmentKind, layer: int, page: int) -> int:
    if not 0 <= page < num_pages:
        raise ValueError(f"page {page} out of range for a pool of {num_pages} pages")
    return segment_offset(layout, num_pages, kind, layer) + page * layout.page_bytes(kind)


def segment_spans(
    layout: KVLayout, num_pages: int, kind: SegmentKind, layer: int, page_ids: Sequence[int], start_index: int = 0
) -> list[Span]:
    """Spans of one layer for page_ids (whose first entry sits at start_index of the request's page list)."""
    page_bytes = layout.page_bytes(kind)
    base = segment_offset(layout, num_pages, kind, layer)
    spans = []
    for index, first_page, count in page_runs(page_ids):
        if first_page < 0 or first_page + count > num_pages:
            raise ValueError(f"pages {first_page}..{first_page + count - 1} out of range for {num_pages} pages")
        spans.append(
            Span(kind, layer, start_index + index, first_page, count, base + first_page * page_bytes, count * page_bytes)
        )
    return spans


def request_spans(layout: KVLayout, num_pages: int, page_ids: Sequence[int]) -> list[list[Span]]:
    """For each segment in layer-major order (layout.segments()), the spans of the request's pages."""
    return [segment_spans(layout, num_pages, kind, layer, page_ids) for kind, layer in layout.segments()]


def byte_view(buffer: torch.Tensor) -> memoryview:
    """A writable 1-D byte memoryview over a contiguous CPU tensor's memory (no copy)."""
    if buffer.device.type != "cpu" or not buffer.is_contiguous():
        raise ValueError("a byte view needs a contiguous CPU tensor")
    return memoryview(buffer.reshape(-1).view(torch.uint8).numpy())


def cache_view(cache: PagedLatentCache) -> tuple[KVLayout, int, memoryview]:
    """(layout, num_pages, bytes of the page region) of a cache built over a flat buffer."""
    shape = cache.shape
    total = shape.target_numel + shape.draft_numel
    return KVLayout.from_cache_shape(shape), shape.num_pages, byte_view(cache.buffer[:total])
