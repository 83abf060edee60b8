"""The Triton device functions both attention kernels call: the score dot and one key block of the
online softmax (flash-attention's running max / normaliser / accumulator, in the log2 domain).

UPCAST (fp32 inputs, or the CPU interpreter, whose tl.dot on bf16 is wrong) casts every operand to float32
and asks for IEEE precision; otherwise the dots take the inputs' dtype and accumulate in float32.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_query(ptrs, mask, UPCAST: tl.constexpr):
    """A query block (masked elements 0), in float32 when UPCAST."""
    q = tl.load(ptrs, mask=mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    return q


@triton.jit
def softmax_start(ROWS: tl.constexpr, COLS: tl.constexpr):
    """The running state before the first key block: (max [ROWS], normaliser [ROWS], acc [ROWS, COLS])."""
    return (tl.full([ROWS], -1.0e30, dtype=tl.float32), tl.zeros([ROWS], dtype=tl.float32),
            tl.zeros([ROWS, COLS], dtype=tl.float32))


@triton.jit
def score_dot(q, keys_t, UPCAST: tl.constexpr):
    """q: [M, D] (already float32 when UPCAST), keys_t: [D, N] -> [M, N] float32 scores."""
    if UPCAST:
        scores = tl.dot(q, keys_t.to(tl.float32), input_precision="ieee")
    else:
        scores = tl.dot(q, keys_t)
    return scores


@triton.jit
def online_softmax_step(m_i, l_i, acc, scores, values, UPCAST: tl.constexpr):
    """Folds one key block into the running state. m_i, l_i: [M] running max and normaliser, acc: [M, Dv]
    float32, scores: [M, N] scaled into the log2 domain with masked keys at -inf, values: [N, Dv]
    -> (m_i, l_i, acc) after the block."""
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if UPCAST:
        acc = acc * alpha[:, None] + tl.dot(p, values.to(tl.float32), input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(values.dtype), values)
    return m_new, l_i, acc
