"""Byte arithmetic over a flat page buffer: where a (kind, layer, page) lives, and a request's spans in order."""
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from engine.cache.kv_cache import PagedLatentCache
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
    if kind == SegmentKind.STATE:  # the state slots follow the pages (aligned); a "page" is a slot
        return layout.state_offset(num_pages)
    if kind == SegmentKind.TARGET:
        return layer * num_pages * layout.page_bytes(SegmentKind.TARGET)
    target_block = layout.num_layers * num_pages * layout.page_bytes(SegmentKind.TARGET)
    return target_block + layer * num_pages * layout.page_bytes(SegmentKind.DRAFT)


def page_offset(layout: KVLayout, num_pages: int, kind: SegmentKind, layer: int, page: int) -> int:
    if not 0 <= page < num_pages:
        raise ValueError(f"page {page} out of range for a pool of {num_pages} pages")
    return segment_offset(layout, num_pages, kind, layer) + page * layout.page_bytes(kind)


def segment_spans(
    layout: KVLayout, num_pages: int, kind: SegmentKind, layer: int, page_ids: Sequence[int], start_index: int = 0,
    num_slots: int | None = None,
) -> list[Span]:
    """Spans of one layer for page_ids (whose first entry sits at start_index of the request's page list).
    kind STATE: page_ids are state slots, checked against num_slots when given."""
    page_bytes = layout.page_bytes(kind)
    base = segment_offset(layout, num_pages, kind, layer)
    limit = (num_slots if num_slots is not None else 1 << 62) if kind == SegmentKind.STATE else num_pages
    spans = []
    for index, first_page, count in page_runs(page_ids):
        if first_page < 0 or first_page + count > limit:
            raise ValueError(f"{kind.name.lower()} units {first_page}..{first_page + count - 1} out of range for {limit}")
        spans.append(
            Span(kind, layer, start_index + index, first_page, count, base + first_page * page_bytes, count * page_bytes)
        )
    return spans


def request_spans(layout: KVLayout, num_pages: int, page_ids: Sequence[int], state_slot: int | None = None,
                  num_slots: int | None = None) -> list[list[Span]]:
    """For each segment in layer-major order (layout.segments()), the spans of the request's pages (and,
    for the STATE segment of a layout with state, of its state slot)."""
    return [segment_spans(layout, num_pages, kind, layer, unit_ids(kind, page_ids, state_slot), 0, num_slots)
            for kind, layer in layout.segments()]


def unit_ids(kind: SegmentKind, page_ids: Sequence[int], state_slot: int | None) -> tuple[int, ...]:
    """What a request's "pages" of a segment kind are: its page ids, or (STATE) its one state slot."""
    if kind != SegmentKind.STATE:
        return tuple(page_ids)
    if state_slot is None:
        raise ValueError("a layout with linear-attention state needs the request's state slot")
    return (state_slot,)


def byte_view(buffer: torch.Tensor) -> memoryview:
    """A writable 1-D byte memoryview over a contiguous CPU tensor's memory (no copy)."""
    if buffer.device.type != "cpu" or not buffer.is_contiguous():
        raise ValueError("a byte view needs a contiguous CPU tensor")
    return memoryview(buffer.reshape(-1).view(torch.uint8).numpy())


def cache_view(cache: PagedLatentCache) -> tuple[KVLayout, int, memoryview]:
    """(layout, num_pages, bytes of the page region and the state slots after it) of a cache built over a
    flat buffer."""
    shape = cache.shape
    numel = -(-shape.buffer_bytes // shape.dtype.itemsize)
    return KVLayout.from_cache_shape(shape), shape.num_pages, byte_view(cache.buffer[:numel])
