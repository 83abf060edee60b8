"""AITER mla_decode_fwd's index arrays built on the device with fixed shapes (CUDA-graph capturable).

mla_decode_fwd reads sequence i's context from kv_indices[kv_indptr[i] : kv_indptr[i + 1]]: page ids (paged
form, the last page holding kv_last_page_lens[i] tokens) or token slots (pages of one token). The compaction
of each row's used entries into that flat array is a scatter to fixed positions (row i's entry j goes to
kv_indptr[i] + j; unused entries all go to one spare slot at the end), not boolean-mask indexing, whose
output size depends on device values (a nonzero: a host sync, and no graph capture)."""
from __future__ import annotations

from typing import NamedTuple

import torch


class DecodeIndices(NamedTuple):
    """mla_decode_fwd's qo_indptr [S+1], kv_indptr [S+1], kv_indices [S*W+1], kv_last_page_lens [S] (int32)."""

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_lens: torch.Tensor


def decode_indices(block_table: torch.Tensor, kv_lens: torch.Tensor, page_size: int, paged: bool,
                   q_len: int = 1) -> DecodeIndices:
    """block_table [S, P] int, kv_lens [S] int (device) -> DecodeIndices. paged: page-level entries (W = P);
    else token slots page * page_size + offset (W = P * page_size). Shapes depend on S, P, page_size only."""
    num_seqs, max_pages = block_table.shape
    device = block_table.device
    table, lens = block_table.long(), kv_lens.long()
    if paged:
        counts = (lens + page_size - 1) // page_size
        entries = table
        last_page_lens = lens - (counts - 1) * page_size
    else:
        positions = torch.arange(max_pages * page_size, device=device)
        entries = table[:, positions // page_size] * page_size + positions % page_size
        counts = lens
        last_page_lens = torch.ones_like(lens)
    width = entries.shape[1]
    kv_indptr = torch.zeros(num_seqs + 1, dtype=torch.int64, device=device)
    kv_indptr[1:] = torch.cumsum(counts, 0)
    column = torch.arange(width, device=device)[None, :]
    spare = num_seqs * width
    destination = torch.where(column < counts[:, None], kv_indptr[:-1, None] + column, spare)
    kv_indices = torch.zeros(spare + 1, dtype=torch.int64, device=device)
    kv_indices.scatter_(0, destination.reshape(-1), entries.reshape(-1))
    qo_indptr = torch.arange(num_seqs + 1, device=device, dtype=torch.int32) * q_len
    return DecodeIndices(qo_indptr, kv_indptr.to(torch.int32), kv_indices.to(torch.int32),
                         last_page_lens.to(torch.int32))
