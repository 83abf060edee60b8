"""A persistent device page table for captured steps, rewritten by deltas instead of re-sent whole.

A captured decode graph reads block_table [rows, width] from one static device tensor. Sending that table
every step (padded to width = max_pages, e.g. 2,560 pages at 163,840 positions) costs O(rows x width) host
work and bytes per step; but a running sequence's page list only grows by a page every page_size tokens.
DeviceBlockTable keeps a host mirror of what the device holds and, per step, writes only the entries that
changed: usually none, a page when a sequence crosses a page boundary, a whole row when a row changes hands.

Invariant relied on (append-only rows): while a row holds the same sequence, the entries below its known
length do not change, except possibly the last one (e.g. a copy-on-write of a shared partial page). A row is
taken to hold the same sequence when its first and its last known page agree with the mirror; otherwise
the whole row is rewritten. Pure host logic plus one scatter on the device (tested on CPU)."""
from __future__ import annotations

import numpy as np
import torch

from engine.runtime.devices import host_to_device


class DeviceBlockTable:
    """table: [rows, width] int32 on `device`; update(page_tables) makes rows 0..len-1 hold those lists."""

    def __init__(self, rows: int, width: int, device: torch.device) -> None:
        if rows < 1 or width < 1:
            raise ValueError(f"a block table needs rows and width >= 1, got {rows} x {width}")
        self.rows, self.width, self.device = rows, width, device
        self.table = torch.zeros(rows, width, dtype=torch.int32, device=device)
        self._mirror = np.zeros((rows, width), dtype=np.int64)
        self._lengths = [0] * rows
        self.entries_written = 0  # running total, for tests and metrics

    def deltas(self, page_tables: list[list[int]]) -> tuple[list[int], list[int]]:
        """(flat indices, page ids) to write so rows 0..len(page_tables)-1 hold page_tables; updates the
        mirror as if they were written. Rows past len(page_tables) keep what they hold (not read)."""
        if len(page_tables) > self.rows:
            raise ValueError(f"{len(page_tables)} page tables for a table of {self.rows} rows")
        indices: list[int] = []
        values: list[int] = []
        for row, pages in enumerate(page_tables):
            count = len(pages)
            if count > self.width:
                raise ValueError(f"a page table of {count} pages does not fit width {self.width}")
            mirror = self._mirror[row]
            known = min(count, self._lengths[row])
            same = known > 0 and pages[0] == mirror[0] and pages[known - 1] == mirror[known - 1]
            start = known if same else 0
            if start < count:
                base = row * self.width
                indices.extend(range(base + start, base + count))
                values.extend(pages[start:count])
                mirror[start:count] = pages[start:count]
            self._lengths[row] = count
        return indices, values

    def update(self, page_tables: list[list[int]]) -> int:
        """Writes the deltas to the device (one host-to-device copy, one scatter; nothing when none changed);
        returns how many entries were written."""
        indices, values = self.deltas(page_tables)
        if indices:
            packed = host_to_device(indices + values, torch.int64, self.device)
            flat_index, flat_values = packed[: len(indices)], packed[len(indices):]
            self.table.view(-1).index_copy_(0, flat_index, flat_values.to(torch.int32))
            self.entries_written += len(indices)
        return len(indices)
