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
from engine.attention.head_table import FLASH_ATTN_VARLEN, MLA_DECODE, check_aiter_dtype, mla_decode_page_size_supported
from engine.forward_batch import AttentionMetadata


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

    def __init__(self, aiter: ModuleType | None = None, mla: ModuleType | None = None) -> None:
        if aiter is None or mla is None:
            aiter, mla = load_aiter()
        self._flash_attn_varlen = aiter.flash_attn_varlen_func
        self._mla_decode = mla.mla_decode_fwd
        self._paged_indptr = _accepts(self._mla_decode, "page_size")

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
        groups of equal q_len (one call in the usual case of uniform q_len)."""
        for tensor in (q, kv_cache):
            check_aiter_dtype(MLA_DECODE, _dtype_name(tensor.dtype))
        if not self.supports_decode_num_heads(q.shape[1]):
            raise ValueError(f"{MLA_DECODE.name} has no {q.shape[1]}-head kernel (it runs {MLA_DECODE.supported()}); "
                             "wrap the backend in HeadPaddedBackend")
        out = torch.empty(q.shape[0], q.shape[1], latent_dim, dtype=q.dtype, device=q.device)
        q_lens = attn.q_lens_cpu
        for q_len in sorted(set(q_lens)):
            seqs = [i for i, n in enumerate(q_lens) if n == q_len]
            if len(seqs) == len(q_lens):
                rows = slice(None)
            else:
                starts = [sum(q_lens[:i]) for i in seqs]
                rows = torch.tensor([s + j for s in starts for j in range(q_len)], device=q.device)
            self._decode_group(q[rows], kv_cache, attn, seqs, q_len, softmax_scale, latent_dim, out, rows)
        return out

    def _decode_group(
        self, q: torch.Tensor, kv_cache: torch.Tensor, attn: AttentionMetadata, seqs: list[int], q_len: int,
        softmax_scale: float, latent_dim: int, out: torch.Tensor, rows: slice | torch.Tensor,
    ) -> None:
        """Runs mla_decode_fwd for the sequences `seqs` (all with q_len queries) and writes out[rows]."""
        device = q.device
        num_pages, page_size, entry_dim = kv_cache.shape
        index = torch.tensor(seqs, device=device)
        kv_lens = attn.kv_lens.to(device)[index].long()
        table = attn.block_table.to(device)[index].long()
        qo_indptr = torch.arange(len(seqs) + 1, device=device, dtype=torch.int32) * q_len
        if self._paged_indptr and mla_decode_page_size_supported(page_size):  # page-level: kv_indptr counts pages
            pages = (kv_lens + page_size - 1) // page_size
            used = torch.arange(table.shape[1], device=device)[None, :] < pages[:, None]
            kv_indices = table[used]
            last_page_lens = kv_lens - (pages - 1) * page_size
            counts, buffer, extra = pages, kv_cache.view(num_pages, page_size, 1, entry_dim), {"page_size": page_size}
        else:  # token-level indices over the cache viewed as pages of one token
            positions = torch.arange(max(attn.kv_lens_cpu[i] for i in seqs), device=device)[None, :]
            used = positions < kv_lens[:, None]
            slots = table.gather(1, (positions // page_size).expand(len(seqs), -1)) * page_size + positions % page_size
            kv_indices = slots[used]
            last_page_lens = torch.ones_like(kv_lens)
            counts, buffer, extra = kv_lens, kv_cache.view(num_pages * page_size, 1, 1, entry_dim), {}
        kv_indptr = torch.zeros(len(seqs) + 1, device=device, dtype=torch.int32)
        kv_indptr[1:] = torch.cumsum(counts, 0)
        group_out = torch.empty(q.shape[0], q.shape[1], latent_dim, dtype=q.dtype, device=device)
        self._mla_decode(
            q.contiguous(), buffer, group_out, qo_indptr, kv_indptr, kv_indices.to(torch.int32),
            last_page_lens.to(torch.int32), q_len, sm_scale=softmax_scale, **extra,
        )
        out[rows] = group_out
