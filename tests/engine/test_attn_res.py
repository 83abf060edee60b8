"""Attention Residuals: the mix is a softmax over proj(RMSNorm(row)) of the RAW rows (K3_SPEC 3.1),
blocks close at layers 0, B, 2B, ..., and a single row passes through unchanged."""
from __future__ import annotations

import torch

from engine.layers.attn_res import ResidualStream, attn_res_mix, is_block_start
from engine.layers.norm import RMSNorm


def _norm(hidden: int, seed: int) -> RMSNorm:
    norm = RMSNorm(hidden, 1e-5)
    norm.weight.data.copy_(torch.randn(hidden, generator=torch.Generator().manual_seed(seed)))
    return norm


def test_mix_matches_formula() -> None:
    """p_j = softmax_j(sum_h v_j[h] / rms(v_j) * w[h] * proj[h]); mix = sum_j p_j v_j."""
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(3, 4, 16, generator=gen) * torch.tensor([1.0, 5.0, 0.1, 2.0]).view(1, 4, 1)
    proj = torch.randn(1, 16, generator=gen)
    norm = _norm(16, 1)
    got = attn_res_mix(rows, proj, norm)
    for t in range(3):
        scores = []
        for j in range(4):
            v = rows[t, j]
            scores.append(float((v / torch.sqrt(v.pow(2).mean() + 1e-5) * norm.weight * proj[0]).sum()))
        p = torch.softmax(torch.tensor(scores), dim=0)
        want = sum(p[j] * rows[t, j] for j in range(4))
        torch.testing.assert_close(got[t], want, atol=1e-5, rtol=1e-5)


def test_single_row_passes_through() -> None:
    """With an empty bank the mix is P itself (layer 0: x_a = input_layernorm(embedding))."""
    p = torch.randn(2, 8)
    stream = ResidualStream(p)
    assert torch.equal(stream.mix(torch.randn(1, 8), _norm(8, 2)), p)


def test_stream_blocks() -> None:
    """close_block appends P and restarts it at zero; add accumulates into P only."""
    emb = torch.randn(2, 8)
    stream = ResidualStream(emb)
    stream.close_block()
    a, b = torch.randn(2, 8), torch.randn(2, 8)
    stream.add(a)
    stream.add(b)
    assert len(stream.bank) == 1 and torch.equal(stream.bank[0], emb)
    torch.testing.assert_close(stream.partial, a + b)
    stream.close_block()
    assert len(stream.bank) == 2 and stream.partial.abs().sum() == 0


def test_block_starts() -> None:
    """Block size 3: layers 0, 3, 6 close a block; 12 for K3's 12 at layer 84 but not 85."""
    assert [i for i in range(8) if is_block_start(i, 3)] == [0, 3, 6]
    assert is_block_start(84, 12) and not is_block_start(85, 12)
