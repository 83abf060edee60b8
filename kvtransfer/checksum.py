"""Checksums over KV bytes: per chunk (gRPC) and per request (completion records).

Algorithm: xxh3_64 from the PyPI package `xxhash` (~30 GiB/s on one core here) when it is installed, else
zlib.crc32 (~4 GiB/s). The algorithm travels with every checksum, so a reader verifies whatever the writer
chose; crc32 is always available on both ends.

Request checksum (documented in docs/kvtransfer.md): for each segment (kind, layer) in layer-major order
(target layers 0..L-1, then draft layers 0..D-1, then the state slot for models with linear attention)
take the digest of that layer's bytes of the request's
pages in page-list order; the request checksum is the digest of those segment digests, each written as
8 little-endian bytes. Per-segment digests let a writer hash each layer as it writes it (chunked prefill
writes layers in any order), and let a reader hash layers independently.
"""
from __future__ import annotations

import enum
import struct
import zlib
from collections.abc import Sequence

from kvtransfer.layout import KVLayout
from kvtransfer.page_spans import Span, request_spans

try:
    import xxhash
except ImportError:  # optional dependency: fall back to the stdlib
    xxhash = None

# A request's KV up to this size is checksummed on the caller's event loop (prefill's completion record,
# decode's admission): xxh3 covers 1 MiB in well under 0.1 ms, less than a hop to a worker thread and back.
INLINE_CHECKSUM_BYTES = 1 << 20


class Algorithm(enum.IntEnum):
    """Values match the KVChecksumAlgorithm enum of protos/pdserve/internal/v1/kv.proto."""

    XXH3_64 = 1
    CRC32 = 2


DEFAULT_ALGORITHM = Algorithm.XXH3_64 if xxhash is not None else Algorithm.CRC32


class Hasher:
    """A streaming digest: update() with buffers in order, then intdigest()."""

    def __init__(self, algorithm: Algorithm = DEFAULT_ALGORITHM) -> None:
        self.algorithm = Algorithm(algorithm)
        if self.algorithm == Algorithm.XXH3_64:
            if xxhash is None:
                raise ValueError("xxh3_64 checksum needs the `xxhash` package (pip install xxhash)")
            self._state = xxhash.xxh3_64()
        else:
            self._crc = 0

    def update(self, data) -> None:
        if self.algorithm == Algorithm.XXH3_64:
            self._state.update(data)
        else:
            self._crc = zlib.crc32(data, self._crc)

    def intdigest(self) -> int:
        return self._state.intdigest() if self.algorithm == Algorithm.XXH3_64 else self._crc


def digest(data, algorithm: Algorithm = DEFAULT_ALGORITHM) -> int:
    """One-shot checksum of a bytes-like object."""
    if Algorithm(algorithm) == Algorithm.XXH3_64:
        if xxhash is None:
            raise ValueError("xxh3_64 checksum needs the `xxhash` package (pip install xxhash)")
        return xxhash.xxh3_64_intdigest(data)
    return zlib.crc32(data)


def combine(segment_digests: Sequence[int], algorithm: Algorithm) -> int:
    """The request checksum from its segment digests (in layer-major order)."""
    return digest(struct.pack(f"<{len(segment_digests)}Q", *segment_digests), algorithm)


def spans_digest(view: memoryview, spans: Sequence[Span], algorithm: Algorithm) -> int:
    """Digest of the bytes of spans (one segment's), read from view, in order."""
    if len(spans) == 1:
        span = spans[0]
        return digest(view[span.offset : span.offset + span.nbytes], algorithm)
    hasher = Hasher(algorithm)
    for span in spans:
        hasher.update(view[span.offset : span.offset + span.nbytes])
    return hasher.intdigest()


def request_checksum(
    view: memoryview, layout: KVLayout, num_pages: int, page_ids: Sequence[int], algorithm: Algorithm,
    state_slot: int | None = None,
) -> tuple[int, int]:
    """(checksum, bytes covered) of a request's pages (and state slot, for a layout with state: the last
    segment) read from a pool's byte view (see module doc)."""
    digests, nbytes = [], 0
    for spans in request_spans(layout, num_pages, page_ids, state_slot):
        digests.append(spans_digest(view, spans, algorithm))
        nbytes += sum(span.nbytes for span in spans)
    return combine(digests, algorithm), nbytes
