"""Attention on AMD AITER kernels (ROCm only; `amd-aiter` on PyPI, imported as `aiter`).

prefill: aiter.flash_attn_varlen_func, bf16 MHA form (q/k head dim 192, v 128), any head count
         (12 per rank runs natively), causal aligned bottom-right.
decode:  aiter.mla.mla_decode_fwd, absorbed form over the paged latent cache viewed as
         [num_pages, page_size, 1, latent + rope] (power-of-two page sizes; any other cache is viewed as
         pages of one token); kernels for 8, 16, 32, 64, 128 heads, so 12 is padded to 16.
What each kernel runs (heads, dtypes, page sizes) comes from engine.attention.head_table, the table
`pdserve plan` reports from too. bf16 / fp8 only: fp32 is refused with an error naming the dtype.
The softmax scale is always passed explicitly: AITER's defaults (1/sqrt(head dim)) are wrong for MLA.
"""
from __future__ import annotations

import importlib
import inspect
from types import ModuleType

import torch

from engine.attention.base import AttentionBackend, VarlenSpans
from engine.attention.aiter_indices import DecodeIndices, decode_indices
from engine.attention.head_table import FLASH_ATTN_VARLEN, MLA_DECODE, check_aiter_dtype, mla_decode_page_size_supported
from engine.runtime.devices import host_to_device
from engine.runtime.forward_batch import AttentionMetadata


def load_aiter() -> tuple[ModuleType, ModuleType]:
    """(aiter, aiter.mla) of AMD's AITER. Raises ImportError when it is missing or when `aiter` is some
    other package (PyPI's unrelated "aiter") that lacks the MLA kernels."""
    aiter = importlib.import_module("aiter")
    mla = importlib.import_module("aiter.mla")
    if not callable(getattr(mla, "mla_decode_fwd", None)) or not callable(getattr(aiter, "flash_attn_varlen_func", None)):
        raise ImportError("the installed `aiter` module is not AMD's AITER (no mla_decode_fwd / flash_attn_varlen_func)")
    return aiter, mla


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _accepts(function: object, parameter: str) -> bool:
    try:
        return parameter in inspect.signature(function).parameters
    except (TypeError, ValueError):
        return False


class AiterAttentionBackend(AttentionBackend):
    """Per-op head support from head_table: prefill (flash_attn_varlen) any count, decode (mla_decode_fwd)
    8, 16, 32, 64 or 128 heads; HeadPaddedBackend pads other counts up.

    aiter / mla: the modules to call (tests inject fakes with AITER's signatures); default: load_aiter()."""

    name = "aiter"
    # decode reads device tensors only (aiter_indices: fixed shapes, no sync). Should mla_decode_fwd itself
    # sync while a graph is captured, that capture fails and the bucket runs eagerly on every rank.
    graph_safe = True

    def __init__(self, aiter: ModuleType | None = None, mla: ModuleType | None = None) -> None:
        if aiter is None or mla is None:
            aiter, mla = load_aiter()
        self._flash_attn_varlen = aiter.flash_attn_varlen_func
        self._mla_decode = mla.mla_decode_fwd
        self._paged_indptr = _accepts(self._mla_decode, "page_size")
        self._memo: tuple[AttentionMetadata, tuple, DecodeIndices] | None = None  # this step's decode indices

    def supports_prefill_num_heads(self, num_heads: int) -> bool:
        return num_heads > 0 and FLASH_ATTN_VARLEN.supports(num_heads)

    def supports_decode_num_heads(self, num_heads: int) -> bool:
        return num_heads > 0 and MLA_DECODE.supports(num_heads)

    def supports_num_heads(self, num_heads: int) -> bool:
        return self.supports_prefill_num_heads(num_heads) and self.supports_decode_num_heads(num_heads)

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans: VarlenSpans,
                softmax_scale: float) -> torch.Tensor:
        """q: [Tq, H, Dqk], k: [Tk, H, Dqk], v: [Tk, H, Dv] -> [Tq, H, Dv] (bf16 / fp16)."""
        check_aiter_dtype(FLASH_ATTN_VARLEN, _dtype_name(q.dtype))
        out = self._flash_attn_varlen(
            q, k, v, spans.cu_seqlens_q.to(torch.int32), spans.cu_seqlens_k.to(torch.int32), spans.max_q_len,
            spans.max_k_len,
            dropout_p=0.0, softmax_scale=softmax_scale, causal=True,
        )
        return out[0] if isinstance(out, tuple) else out

    def decode(self, q: torch.Tensor, kv_cache: torch.Tensor, attn: AttentionMetadata, softmax_scale: float,
               latent_dim: int) -> torch.Tensor:
        """q: [T, H, latent+rope] (H one of mla_decode_fwd's head counts; bf16 / fp8 q and cache) -> [T, H, latent].

        AITER lays multi-token queries out as [num_seqs, max_seqlen_q], so sequences are run in
        groups of equal q_len (one call in the usual case of uniform q_len, the only case a graph captures)."""
        for tensor in (q, kv_cache):
            check_aiter_dtype(MLA_DECODE, _dtype_name(tensor.dtype))
        if not self.supports_decode_num_heads(q.shape[1]):
            raise ValueError(f"{MLA_DECODE.name} has no {q.shape[1]}-head kernel (it runs {MLA_DECODE.supported()}); "
                             "wrap the backend in HeadPaddedBackend")
        q_lens = attn.q_lens_cpu
        if len(set(q_lens)) == 1:
            return self._decode_group(q, kv_cache, attn, None, q_lens[0], softmax_scale, latent_dim)
        out = torch.empty(q.shape[0], q.shape[1], latent_dim, dtype=q.dtype, device=q.device)
        for q_len in sorted(set(q_lens)):
            seqs = [i for i, n in enumerate(q_lens) if n == q_len]
            starts = [sum(q_lens[:i]) for i in seqs]
            rows = host_to_device([s + j for s in starts for j in range(q_len)], torch.int64, q.device)
            out[rows] = self._decode_group(q.index_select(0, rows), kv_cache, attn, seqs, q_len, softmax_scale,
                                           latent_dim)
        return out

    def _decode_group(self, q: torch.Tensor, kv_cache: torch.Tensor, attn: AttentionMetadata,
                      seqs: list[int] | None, q_len: int, softmax_scale: float, latent_dim: int) -> torch.Tensor:
        """mla_decode_fwd for the sequences `seqs` (None: all; each with q_len queries) -> [rows, H, latent]."""
        num_pages, page_size, entry_dim = kv_cache.shape
        paged = self._paged_indptr and mla_decode_page_size_supported(page_size)
        indices = self._indices(attn, seqs, page_size, paged, q_len)
        if paged:  # page-level: kv_indptr counts pages
            buffer, extra = kv_cache.view(num_pages, page_size, 1, entry_dim), {"page_size": page_size}
        else:  # token-level indices over the cache viewed as pages of one token
            buffer, extra = kv_cache.view(num_pages * page_size, 1, 1, entry_dim), {}
        group_out = torch.empty(q.shape[0], q.shape[1], latent_dim, dtype=q.dtype, device=q.device)
        self._mla_decode(q.contiguous(), buffer, group_out, *indices, q_len, sm_scale=softmax_scale, **extra)
        return group_out

    def _indices(self, attn: AttentionMetadata, seqs: list[int] | None, page_size: int, paged: bool,
                 q_len: int) -> DecodeIndices:
        """mla_decode_fwd's indptr / indices for `seqs` of attn, computed once per step (every layer shares
        attn) with fixed shapes from device tensors: no boolean-mask indexing, no host read, no blocking copy,
        so a captured graph replays it (decode_indices)."""
        key = (tuple(seqs) if seqs is not None else None, page_size, paged, q_len)
        if self._memo is not None and self._memo[0] is attn and self._memo[1] == key:
            return self._memo[2]
        table, kv_lens = attn.block_table, attn.kv_lens
        if seqs is not None:
            index = host_to_device(seqs, torch.int64, table.device)
            table, kv_lens = table.index_select(0, index), kv_lens.index_select(0, index)
        indices = decode_indices(table, kv_lens, page_size, paged, q_len)
        self._memo = (attn, key, indices)
        return indices
