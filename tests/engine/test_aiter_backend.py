"""The AITER backend drives AITER's real call signatures correctly: against a fake `aiter` module that keeps
AITER's argument lists, head counts (non-persistent mla_decode_fwd: 8, 16, 32, 64, 128), dtypes (bf16 / fp8,
never fp32) and page sizes (powers of two) and computes from the indices it is given, prefill and decode
(12 heads: prefill native, decode padded to 16; 48 padded to 64) equal the torch reference in bf16, the softmax
scale is always passed explicitly, fp32 is refused naming the dtype, and the engine's head table (shared with
`pdserve plan`) states exactly what the fake enforces. Also: an unrelated module named `aiter` is unavailable."""
from __future__ import annotations

import sys
import types

import pytest
import torch

from engine.attention import head_table
from engine.attention.aiter_backend import AiterAttentionBackend, load_aiter
from engine.attention.base import VarlenSpans
from engine.attention.head_padding import HeadPaddedBackend
from engine.attention.torch_backend import TorchAttentionBackend
from engine.runtime.forward_batch import build_attention_metadata

REFERENCE = TorchAttentionBackend()
LATENT, ROPE, PAGE = 32, 16, 16
# What AITER's source says (ROCm/aiter aiter/mla.py, csrc asm_mla): the fake enforces these independently
# of engine.attention.head_table, and test_head_table_states_what_aiter_enforces compares the two.
AITER_DECODE_HEADS = (8, 16, 32, 64, 128)
AITER_DTYPES = (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e4m3fnuz)
BF16 = {"rtol": 2e-2, "atol": 2e-2}


def _causal_attention(q, k, v, scale):
    """q: [Lq, H, Dqk], k: [Lk, Dqk] or [Lk, H, Dqk], v likewise -> [Lq, H, Dv] float32, bottom-right causal."""
    if k.dim() == 2:
        k, v = k[:, None].expand(-1, q.shape[1], -1), v[:, None].expand(-1, q.shape[1], -1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    visible = torch.arange(k.shape[0])[None, :] <= torch.arange(q.shape[0])[:, None] + (k.shape[0] - q.shape[0])
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v.float())


class FakeAiter:
    """aiter.flash_attn_varlen_func and aiter.mla.mla_decode_fwd with AITER's signatures (facts from
    ROCm/aiter: aiter/ops/mha.py, aiter/mla.py) and AITER's constraints asserted."""

    def __init__(self, paged: bool = True) -> None:
        self.calls: list[tuple[str, int, float]] = []
        self.aiter = types.ModuleType("aiter")
        self.aiter.flash_attn_varlen_func = self.flash_attn_varlen_func
        self.mla = types.ModuleType("aiter.mla")
        self.mla.mla_decode_fwd = self.mla_decode_fwd if paged else self.legacy_mla_decode_fwd

    def flash_attn_varlen_func(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                               softmax_scale=None, causal=False, window_size=(-1, -1), bias=None, alibi_slopes=None,
                               deterministic=False, return_lse=False, return_attn_probs=False, block_table=None):
        assert softmax_scale is not None, "AITER's default scale (1/sqrt(192)) is wrong for MLA"
        assert q.dtype in (torch.bfloat16, torch.float16), f"flash_attn_varlen_func: {q.dtype} not supported"
        assert causal and dropout_p == 0.0
        assert cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32
        cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        assert max_seqlen_q == max(b - a for a, b in zip(cu_q, cu_q[1:]))
        assert max_seqlen_k == max(b - a for a, b in zip(cu_k, cu_k[1:]))
        self.calls.append(("prefill", q.shape[1], softmax_scale))
        out = torch.empty(q.shape[0], q.shape[1], v.shape[2], dtype=q.dtype)
        for i in range(len(cu_q) - 1):
            rows = slice(cu_q[i], cu_q[i + 1])
            keys = slice(cu_k[i], cu_k[i + 1])
            out[rows] = _causal_attention(q[rows], k[keys], v[keys], softmax_scale).to(q.dtype)
        return out

    def mla_decode_fwd(self, q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, max_seqlen_q,
                       page_size=1, nhead_kv=1, sm_scale=None, logit_cap=0.0, num_kv_splits=None, **unused):
        assert sm_scale is not None, "AITER's default scale (1/sqrt(576)) is wrong once yarn mscale applies"
        total, heads, entry = q.shape
        assert heads in AITER_DECODE_HEADS, f"mla_decode_fwd: nhead={heads} not supported"
        assert q.dtype in AITER_DTYPES and kv_buffer.dtype in AITER_DTYPES, f"mla_decode_fwd: {q.dtype} not supported"
        assert page_size & (page_size - 1) == 0, f"mla_decode_fwd: page_size {page_size} is not a power of two"
        assert kv_buffer.dim() == 4 and kv_buffer.shape[1] == page_size and kv_buffer.shape[2] == nhead_kv == 1
        assert kv_buffer.shape[3] == entry and o.shape[:2] == (total, heads)
        for tensor in (qo_indptr, kv_indptr, kv_indices, kv_last_page_lens):
            assert tensor.dtype == torch.int32
        qo, kv = qo_indptr.tolist(), kv_indptr.tolist()
        assert all(b - a == max_seqlen_q for a, b in zip(qo, qo[1:])), "AITER wants uniform q_len"
        self.calls.append(("decode", heads, sm_scale))
        latent = o.shape[2]
        for i in range(len(qo) - 1):
            pages = kv_indices[kv[i] : kv[i + 1]].long()
            tokens = (len(pages) - 1) * page_size + int(kv_last_page_lens[i])
            assert 1 <= int(kv_last_page_lens[i]) <= page_size
            context = kv_buffer[pages].reshape(-1, entry)[:tokens]
            o[qo[i] : qo[i + 1]] = _causal_attention(q[qo[i] : qo[i + 1]], context, context[:, :latent], sm_scale).to(o.dtype)
        return o, None

    def legacy_mla_decode_fwd(self, q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens,
                              max_seqlen_q, sm_scale=None, logit_cap=0.0, num_kv_splits=None):
        """Older AITER: no page_size argument, pages of one token."""
        assert kv_buffer.shape[1] == 1
        assert bool((kv_last_page_lens == 1).all())
        return self.mla_decode_fwd(q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens,
                                   max_seqlen_q, page_size=1, sm_scale=sm_scale)


def _paged_case(generator, heads, q_lens, kv_lens, page=PAGE, dtype=torch.bfloat16):
    num_pages = sum(-(-n // page) for n in kv_lens) + 3
    order = torch.randperm(num_pages, generator=generator).tolist()
    tables, used = [], 0
    for kv_len in kv_lens:
        count = -(-kv_len // page)
        tables.append(order[used : used + count])
        used += count
    attn = build_attention_metadata(list(q_lens), list(kv_lens), tables, page)
    cache = torch.randn(num_pages, page, LATENT + ROPE, generator=generator).to(dtype)
    q = torch.randn(sum(q_lens), heads, LATENT + ROPE, generator=generator).to(dtype)
    return q, cache, attn


def _reference_decode(q, cache, attn, scale):
    """The torch backend in fp32 on the same (bf16-rounded) inputs."""
    return REFERENCE.decode(q.float(), cache.float(), attn, scale, LATENT)


def test_prefill_runs_12_heads_natively_with_explicit_scale():
    """flash_attn_varlen_func gets the 12 real heads (no padding) and our scale; result equals the reference."""
    fake = FakeAiter()
    backend = HeadPaddedBackend(AiterAttentionBackend(fake.aiter, fake.mla))
    generator = torch.Generator().manual_seed(0)
    q_lens, k_lens = (5, 17, 2), (5, 30, 9)
    q = torch.randn(sum(q_lens), 12, 48, generator=generator).bfloat16()
    k = torch.randn(sum(k_lens), 12, 48, generator=generator).bfloat16()
    v = torch.randn(sum(k_lens), 12, 32, generator=generator).bfloat16()
    spans = VarlenSpans.from_lens(q_lens, k_lens)
    out = backend.prefill(q, k, v, spans, 0.123)
    expected = REFERENCE.prefill(q.float(), k.float(), v.float(), spans, 0.123)
    torch.testing.assert_close(out.float(), expected, **BF16)
    assert fake.calls == [("prefill", 12, 0.123)]


@pytest.mark.parametrize("paged", [True, False], ids=["page-level", "token-level"])
@pytest.mark.parametrize(
    ("q_lens", "kv_lens"),
    [((1, 1, 1), (1, 17, 40)), ((3, 3), (35, 3)), ((4, 1, 4), (20, 16, 33))],
    ids=["decode", "spec-verify", "mixed-q-lens"],
)
def test_decode_pads_12_heads_to_16_and_matches_reference(paged, q_lens, kv_lens):
    """mla_decode_fwd sees 16 heads, page-level (or legacy token-level) indices it can resolve to exactly
    each sequence's context, one call per distinct q_len, and our scale; the 12 real heads equal the reference."""
    fake = FakeAiter(paged=paged)
    backend = HeadPaddedBackend(AiterAttentionBackend(fake.aiter, fake.mla))
    generator = torch.Generator().manual_seed(sum(kv_lens))
    q, cache, attn = _paged_case(generator, 12, q_lens, kv_lens)
    out = backend.decode(q, cache, attn, 0.0911, LATENT)
    assert out.shape == (sum(q_lens), 12, LATENT)
    torch.testing.assert_close(out.float(), _reference_decode(q, cache, attn, 0.0911), **BF16)
    assert fake.calls == [("decode", 16, 0.0911)] * len(set(q_lens))


def test_backend_declares_per_op_head_support():
    """Prefill runs any head count; decode 8, 16, 32, 64 or 128 (12 -> 16, 48 -> 64, 96 -> 128); the whole
    backend needs both."""
    fake = FakeAiter()
    backend = AiterAttentionBackend(fake.aiter, fake.mla)
    assert backend.supports_prefill_num_heads(12) and not backend.supports_decode_num_heads(12)
    assert all(backend.supports_decode_num_heads(n) for n in AITER_DECODE_HEADS)
    assert not any(backend.supports_decode_num_heads(n) for n in (4, 12, 24, 48, 80, 96, 112, 256))
    assert not backend.supports_num_heads(12) and backend.supports_num_heads(32)
    padded = HeadPaddedBackend(backend)
    assert [padded.padded_heads(n, "decode") for n in (1, 12, 24, 48, 96)] == [8, 16, 32, 64, 128]


def test_an_unrelated_aiter_package_counts_as_unavailable(monkeypatch):
    """PyPI's unrelated `aiter` (no MLA kernels) must not be mistaken for AMD's AITER."""
    impostor = types.ModuleType("aiter")
    impostor_mla = types.ModuleType("aiter.mla")
    monkeypatch.setitem(sys.modules, "aiter", impostor)
    monkeypatch.setitem(sys.modules, "aiter.mla", impostor_mla)
    with pytest.raises(ImportError, match="not AMD's AITER"):
        load_aiter()


def test_real_looking_aiter_module_is_accepted(monkeypatch):
    """A module with AITER's entry points loads, and the backend built from it calls into it."""
    fake = FakeAiter()
    monkeypatch.setitem(sys.modules, "aiter", fake.aiter)
    monkeypatch.setitem(sys.modules, "aiter.mla", fake.mla)
    aiter, mla = load_aiter()
    assert aiter is fake.aiter and mla is fake.mla
    backend = AiterAttentionBackend()
    q, cache, attn = _paged_case(torch.Generator().manual_seed(5), 16, (1,), (9,))
    backend.decode(q, cache, attn, 0.2, LATENT)
    assert fake.calls == [("decode", 16, 0.2)]


def test_head_table_states_what_aiter_enforces():
    """engine.attention.head_table (also read by `pdserve plan`) lists exactly the decode head counts and
    dtypes the fake AITER (AITER's source) accepts, and refuses fp32 everywhere."""
    assert head_table.MLA_DECODE.allowed == AITER_DECODE_HEADS
    assert set(head_table.MLA_DECODE.dtypes) == {str(d).removeprefix("torch.") for d in AITER_DTYPES}
    assert head_table.MLA_PREFILL.allowed == (16, 128)
    assert head_table.FP8_MHA_PREFILL.allowed == (1, 2, 4, 8, 10, 16, 32, 40, 48, 64, 96, 128)
    for kernel in head_table.KERNELS[:-1]:  # every AITER kernel; the last row is the triton / torch fallback
        assert "float32" not in kernel.dtypes
    assert [head_table.mla_decode_page_size_supported(p) for p in (1, 16, 64, 12, 0)] == [True] * 3 + [False] * 2


@pytest.mark.parametrize("op", ["prefill", "decode"])
def test_fp32_is_refused_naming_the_dtype(op):
    """AITER has no fp32 MLA / flash kernels: the backend raises ValueError naming float32 before calling AITER."""
    fake = FakeAiter()
    backend = HeadPaddedBackend(AiterAttentionBackend(fake.aiter, fake.mla))
    q, cache, attn = _paged_case(torch.Generator().manual_seed(2), 16, (1,), (9,), dtype=torch.float32)
    with pytest.raises(ValueError, match="float32"):
        if op == "decode":
            backend.decode(q, cache, attn, 0.1, LATENT)
        else:
            backend.prefill(q, q, q[:, :, :LATENT], VarlenSpans.from_lens((1,), (1,)), 0.1)
    assert fake.calls == []


@pytest.mark.parametrize(("heads", "runs"), [(48, 64), (8, 8)])
def test_decode_pads_to_the_next_kernel_head_count(heads, runs):
    """48 heads run on the 64-head kernel, 8 heads natively; the real heads equal the reference."""
    fake = FakeAiter()
    backend = HeadPaddedBackend(AiterAttentionBackend(fake.aiter, fake.mla))
    q, cache, attn = _paged_case(torch.Generator().manual_seed(heads), heads, (1, 1), (5, 20))
    out = backend.decode(q, cache, attn, 0.07, LATENT)
    torch.testing.assert_close(out.float(), _reference_decode(q, cache, attn, 0.07), **BF16)
    assert fake.calls == [("decode", runs, 0.07)]


def test_non_power_of_two_pages_use_token_level_indices():
    """A cache with 12-token pages (not a page size mla_decode_fwd takes) is passed as pages of one token."""
    fake = FakeAiter()
    backend = HeadPaddedBackend(AiterAttentionBackend(fake.aiter, fake.mla))
    q, cache, attn = _paged_case(torch.Generator().manual_seed(12), 16, (1, 1), (7, 30), page=12)
    out = backend.decode(q, cache, attn, 0.05, LATENT)
    torch.testing.assert_close(out.float(), _reference_decode(q, cache, attn, 0.05), **BF16)


@pytest.mark.parametrize("paged", [True, False])
def test_fixed_shape_indices_equal_the_masked_compaction(paged):
    """decode_indices (a scatter to fixed positions, graph capturable) gives the same kv_indptr and, within
    kv_indptr[-1], the same kv_indices as compacting each row's used entries with a boolean mask."""
    from engine.attention.aiter_indices import decode_indices

    generator = torch.Generator().manual_seed(3)
    table = torch.randint(0, 50, (4, 6), generator=generator, dtype=torch.int32)
    kv_lens = torch.tensor([1, 16, 17, 96])
    got = decode_indices(table, kv_lens, PAGE, paged, q_len=2)
    if paged:
        counts = (kv_lens + PAGE - 1) // PAGE
        entries = table.long()
    else:
        positions = torch.arange(6 * PAGE)
        entries = table.long()[:, positions // PAGE] * PAGE + positions % PAGE
        counts = kv_lens
    used = torch.arange(entries.shape[1])[None, :] < counts[:, None]
    expected = entries[used]
    assert got.kv_indptr.tolist() == [0, *torch.cumsum(counts, 0).tolist()]
    assert got.kv_indices[: len(expected)].tolist() == expected.tolist()
    assert got.kv_indices.shape == (entries.numel() + 1,) and got.qo_indptr.tolist() == [0, 2, 4, 6, 8]
    expected_last = kv_lens - (counts - 1) * PAGE if paged else torch.ones(4, dtype=torch.int64)
    assert got.kv_last_page_lens.tolist() == expected_last.tolist()
