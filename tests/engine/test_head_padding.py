"""Head padding: a backend whose kernels only take multiples of 16 heads gives, through HeadPaddedBackend,
bit-for-bit the per-head reference result for every head count, and the pure helpers pick the right count."""
from __future__ import annotations

import pytest
import torch

from engine.attention.base import AttentionBackend, VarlenSpans
from engine.attention.head_padding import HeadPaddedBackend, next_supported_head_count, pad_heads
from engine.attention.torch_backend import TorchAttentionBackend
from engine.runtime.forward_batch import AttentionMetadata, build_attention_metadata

REFERENCE = TorchAttentionBackend()
SCALE = 0.17
LATENT, ROPE = 16, 8


def _head(x: torch.Tensor, head: int) -> torch.Tensor:
    return x[:, head : head + 1].contiguous()


def per_head_prefill(q, k, v, spans):
    """Reference maths one head at a time on contiguous copies (so the result cannot depend on how many
    heads ride along or on memory layout)."""
    return torch.cat(
        [REFERENCE.prefill(_head(q, h), _head(k, h), _head(v, h), spans, SCALE)
         for h in range(q.shape[1])], dim=1)


def per_head_decode(q, cache, attn):
    return torch.cat([REFERENCE.decode(_head(q, h), cache, attn, SCALE, LATENT) for h in range(q.shape[1])], dim=1)


class MultipleOf16Kernel(AttentionBackend):
    """A fake kernel: refuses any head count that is not a multiple of 16, otherwise computes per head."""

    name = "fake16"

    def __init__(self) -> None:
        self.seen_heads: list[int] = []

    def supports_num_heads(self, num_heads: int) -> bool:
        return num_heads % 16 == 0

    def _check(self, *tensors: torch.Tensor) -> None:
        heads = tensors[0].shape[1]
        if heads % 16 or any(t.shape[1] != heads for t in tensors):
            raise RuntimeError(f"fake kernel: bad head counts {[t.shape[1] for t in tensors]}")
        self.seen_heads.append(heads)

    def prefill(self, q, k, v, spans, softmax_scale):
        self._check(q, k, v)
        assert softmax_scale == SCALE
        return per_head_prefill(q, k, v, spans)

    def decode(self, q, kv_cache, attn: AttentionMetadata, softmax_scale, latent_dim):
        self._check(q)
        assert softmax_scale == SCALE and latent_dim == LATENT
        return per_head_decode(q, kv_cache, attn)


class PrefillAnyDecode16(MultipleOf16Kernel):
    """Per-op declarations, like AITER: prefill runs any head count, decode wants multiples of 16."""

    def supports_prefill_num_heads(self, num_heads: int) -> bool:
        return num_heads > 0

    def supports_decode_num_heads(self, num_heads: int) -> bool:
        return num_heads % 16 == 0

    def prefill(self, q, k, v, spans, softmax_scale):
        self.seen_heads.append(q.shape[1])
        return per_head_prefill(q, k, v, spans)


def _prefill_inputs(heads: int, generator: torch.Generator):
    """A fresh sequence and a chunked one (k_len > q_len)."""
    q_lens, k_lens = (3, 7), (3, 11)
    q = torch.randn(sum(q_lens), heads, 12, generator=generator)
    k = torch.randn(sum(k_lens), heads, 12, generator=generator)
    v = torch.randn(sum(k_lens), heads, 8, generator=generator)
    return q, k, v, VarlenSpans.from_lens(q_lens, k_lens)


@pytest.fixture
def one_thread():
    """Thousands of tiny per-head ops: one intra-op thread is faster and immune to a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _decode_inputs(heads: int, generator: torch.Generator):
    attn = build_attention_metadata([1, 3], [5, 9], [[2, 4], [0, 3, 1]], page_size=4)
    cache = torch.randn(5, 4, LATENT + ROPE, generator=generator)
    q = torch.randn(4, heads, LATENT + ROPE, generator=generator)
    return q, cache, attn


@pytest.mark.parametrize(
    ("num_heads", "supported", "expected"),
    [(12, (16, 32), 16), (16, (16, 32), 16), (17, (16, 32), 32), (1, (16,), 16), (12, (32, 16), 16),
     (10, (1, 2, 4, 8, 10, 16), 10), (12, (1, 2, 4, 8, 10, 16, 32), 16), (12, lambda n: n % 16 == 0, 16),
     (33, lambda n: n % 16 == 0, 48), (5, lambda n: n > 0, 5)],
)
def test_next_supported_head_count_picks_the_smallest_supported_count_at_or_above(num_heads, supported, expected):
    """The padded count is the smallest supported count >= num_heads, from a tuple or a predicate."""
    assert next_supported_head_count(num_heads, supported) == expected


@pytest.mark.parametrize(("num_heads", "supported"), [(0, (16,)), (33, (16, 32)), (5, lambda n: False)])
def test_next_supported_head_count_rejects_impossible_requests(num_heads, supported):
    """No supported count (or a non-positive head count) is an error, not a silent truncation."""
    with pytest.raises(ValueError):
        next_supported_head_count(num_heads, supported)


def test_pad_heads_appends_zero_heads_and_keeps_the_real_ones():
    """Padding keeps heads 0..H-1 unchanged and adds exact zeros."""
    x = torch.randn(3, 5, 4)
    padded = pad_heads(x, 8)
    assert padded.shape == (3, 8, 4)
    assert torch.equal(padded[:, :5], x) and not padded[:, 5:].any()
    assert pad_heads(x, 5) is x


def test_fake_kernel_refuses_unpadded_head_counts():
    """The fake really enforces its constraint, so the exactness test below goes through the padding."""
    q, k, v, spans = _prefill_inputs(12, torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError):
        MultipleOf16Kernel().prefill(q, k, v, spans, SCALE)


def test_padding_is_exact_for_head_counts_1_to_40(one_thread):
    """For 1..40 heads the padded run equals the unpadded per-head reference bit for bit (prefill and
    decode), the kernel only ever sees multiples of 16, and the result matches the batched torch backend."""
    generator = torch.Generator().manual_seed(1)
    kernel = MultipleOf16Kernel()
    padded = HeadPaddedBackend(kernel, supported=kernel.supports_num_heads)
    for heads in range(1, 41):
        q, k, v, spans = _prefill_inputs(heads, generator)
        out = padded.prefill(q, k, v, spans, SCALE)
        assert out.shape == (q.shape[0], heads, v.shape[2])
        assert torch.equal(out, per_head_prefill(q, k, v, spans)), heads
        torch.testing.assert_close(out, REFERENCE.prefill(q, k, v, spans, SCALE))

        q, cache, attn = _decode_inputs(heads, generator)
        out = padded.decode(q, cache, attn, SCALE, LATENT)
        assert out.shape == (q.shape[0], heads, LATENT)
        assert torch.equal(out, per_head_decode(q, cache, attn)), heads
        torch.testing.assert_close(out, REFERENCE.decode(q, cache, attn, SCALE, LATENT))
    assert set(kernel.seen_heads) == {16, 32, 48}


def test_explicit_supported_tuple_pads_to_listed_counts():
    """An explicit tuple (AITER's persistent prefill set, which lacks 12) decides the padded count."""
    kernel = MultipleOf16Kernel()
    padded = HeadPaddedBackend(kernel, supported=(1, 2, 4, 8, 10, 16, 32, 40, 48, 64, 96, 128))
    q, k, v, spans = _prefill_inputs(12, torch.Generator().manual_seed(2))
    out = padded.prefill(q, k, v, spans, SCALE)
    assert kernel.seen_heads == [16]
    assert torch.equal(out, per_head_prefill(q, k, v, spans))


def test_per_op_support_pads_only_the_op_that_needs_it():
    """With per-op declarations, 12-head prefill runs natively and only decode is padded to 16."""
    kernel = PrefillAnyDecode16()
    padded = HeadPaddedBackend(kernel)
    generator = torch.Generator().manual_seed(3)
    q, k, v, spans = _prefill_inputs(12, generator)
    padded.prefill(q, k, v, spans, SCALE)
    q, cache, attn = _decode_inputs(12, generator)
    out = padded.decode(q, cache, attn, SCALE, LATENT)
    assert kernel.seen_heads == [12, 16]
    assert padded.padded_heads(12, "prefill") == 12 and padded.padded_heads(12, "decode") == 16
    assert torch.equal(out, per_head_decode(q, cache, attn))
