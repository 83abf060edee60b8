"""LatentMoE + SiTU: the engine block equals a per-token loop over the chosen experts written from the
equations (router on the full width, latent experts from dequantised MXFP4, norm, up-projection, shared)."""
from __future__ import annotations

import math

import pytest
import torch

from engine.runtime.distributed import TPGroup
from engine.layers.latent_moe import LatentMoE, LatentMoEShape
from engine.layers.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from engine.layers.situ import situ_glu

SHAPE = LatentMoEShape(hidden_size=64, latent_size=32, intermediate_size=64, num_experts=8, top_k=2,
                       shared_intermediate_size=48, use_norm=True, renormalize=True, routed_scaling_factor=1.5,
                       situ_beta=4.0, situ_linear_beta=25.0, rms_norm_eps=1e-5)


def test_situ_values() -> None:
    """SiTU-GLU(g, u) = 4 tanh(g/4) sigmoid(g) * 25 tanh(u/25), and caps large inputs."""
    g, u = torch.tensor([0.5, -2.0, 100.0]), torch.tensor([1.0, 3.0, 1000.0])
    got = situ_glu(g, u, 4.0, 25.0)
    for i in range(3):
        gi, ui = g[i].item(), u[i].item()
        want = 4 * math.tanh(gi / 4) / (1 + math.exp(-gi)) * 25 * math.tanh(ui / 25)
        assert got[i].item() == pytest.approx(want, rel=1e-6)
    assert got[2].item() == pytest.approx(100.0, rel=1e-4)


def _filled(shape: LatentMoEShape, seed: int) -> LatentMoE:
    gen = torch.Generator().manual_seed(seed)
    moe = LatentMoE(shape, TPGroup(), torch.float32)
    for name, param in moe.named_parameters():
        param.data.copy_(torch.randn(param.shape, generator=gen) * (0.3 if "norm" not in name else 1.0))
    for expert in range(shape.num_experts):
        for proj, (rows, cols) in (("w1", (shape.intermediate_size, shape.latent_size)),
                                   ("w3", (shape.intermediate_size, shape.latent_size)),
                                   ("w2", (shape.latent_size, shape.intermediate_size))):
            packed, scale = quantize_mxfp4(torch.randn(rows, cols, generator=gen) * 0.2)
            moe.experts.target(expert, proj, "packed").copy_(packed)
            moe.experts.target(expert, proj, "scale").copy_(scale)
    return moe


def _reference(moe: LatentMoE, x: torch.Tensor) -> torch.Tensor:
    s = moe.shape
    ex = moe.experts
    out = []
    for t in range(x.shape[0]):
        xt = x[t]
        scores = torch.sigmoid(moe.gate.weight @ xt)
        chosen = torch.topk(scores + moe.gate.e_score_correction_bias, s.top_k).indices.tolist()
        w = scores[chosen] / (scores[chosen].sum() + 1e-20) * s.routed_scaling_factor
        u = moe.routed_expert_down_proj.weight @ xt
        latent = torch.zeros(s.latent_size)
        for weight, e in zip(w, chosen):
            gate_up = dequantize_mxfp4(ex.w13_packed[e], ex.w13_scale[e]) @ u
            h = situ_glu(gate_up[: s.intermediate_size], gate_up[s.intermediate_size :], 4.0, 25.0)
            latent += weight * (dequantize_mxfp4(ex.w2_packed[e], ex.w2_scale[e]) @ h)
        normed = latent / torch.sqrt(latent.pow(2).mean() + s.rms_norm_eps) * moe.routed_expert_norm.weight
        y = moe.routed_expert_up_proj.weight @ normed
        sh = moe.shared_experts
        y = y + sh.down_proj.weight @ situ_glu(sh.gate_proj.weight @ xt, sh.up_proj.weight @ xt, 4.0, 25.0)
        out.append(y)
    return torch.stack(out)


@pytest.mark.parametrize("num_tokens", [1, 5, 40])
def test_latent_moe_matches_per_token_reference(num_tokens: int) -> None:
    """Grouped expert computation over any token count equals the per-token formula (1e-5, float32)."""
    moe = _filled(SHAPE, seed=num_tokens)
    x = torch.randn(num_tokens, SHAPE.hidden_size, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        torch.testing.assert_close(moe(x), _reference(moe, x), atol=1e-5, rtol=1e-5)


def test_bias_only_selects() -> None:
    """A large correction bias on expert 3 makes every token choose it, but its weight stays the unbiased score."""
    moe = _filled(SHAPE, seed=1)
    moe.gate.e_score_correction_bias.data.zero_()
    moe.gate.e_score_correction_bias.data[3] = 100.0
    x = torch.randn(6, SHAPE.hidden_size, generator=torch.Generator().manual_seed(2))
    weights, ids = moe.gate(x)
    assert (ids == 3).any(dim=1).all()
    assert weights.sum(dim=1).allclose(torch.full((6,), SHAPE.routed_scaling_factor), atol=1e-5)


def test_expert_sharding_sums_to_whole() -> None:
    """Each rank's experts (ranks 0 and 1 of 2) cover disjoint halves whose latent sums add up to the full sum."""
    from engine.layers.latent_moe import run_packed_experts

    full = _filled(SHAPE, seed=4)
    u = torch.randn(9, SHAPE.latent_size, generator=torch.Generator().manual_seed(5))
    weights, ids = full.gate(torch.randn(9, SHAPE.hidden_size, generator=torch.Generator().manual_seed(6)))
    whole = run_packed_experts(full.experts, 0, u, weights, ids, 4.0, 25.0)
    parts = torch.zeros_like(whole)
    for rank in range(2):
        shard = LatentMoE(SHAPE, TPGroup(rank, 2), torch.float32)
        for name, buffer in shard.experts.named_buffers():
            buffer.copy_(getattr(full.experts, name)[rank * 4 : rank * 4 + 4])
        parts += run_packed_experts(shard.experts, shard.expert_start, u, weights, ids, 4.0, 25.0)
    torch.testing.assert_close(parts, whole, atol=1e-5, rtol=1e-5)


def test_bad_shape() -> None:
    """top_k above the expert count is a ValueError naming it."""
    with pytest.raises(ValueError, match="top_k"):
        LatentMoEShape(64, 32, 64, 4, 5, 0, False, True, 1.0, 4.0, 25.0, 1e-5)


@pytest.mark.parametrize("num_tokens", [1, 8])
def test_dense_decoded_path_equals_packed_experts(num_tokens: int) -> None:
    """A small CPU step runs every expert densely over the decoded weights: the same sum as the per-expert
    MXFP4 path (1e-5), and the decoded copy follows a later write to the packed weights."""
    from engine.kernels.moe_torch import use_dense_moe
    from engine.layers.latent_moe import run_packed_experts

    moe = _filled(SHAPE, seed=11)
    assert use_dense_moe(num_tokens, SHAPE.num_experts, SHAPE.latent_size, SHAPE.intermediate_size)
    x = torch.randn(num_tokens, SHAPE.hidden_size, generator=torch.Generator().manual_seed(12))
    with torch.no_grad():
        torch.testing.assert_close(moe(x), _reference(moe, x), atol=1e-5, rtol=1e-5)
        u = moe.routed_expert_down_proj(x)
        weights, ids = moe.gate(x)
        packed = run_packed_experts(moe.experts, 0, u, weights, ids, 4.0, 25.0)
        before = moe.experts.dequantized()[0].clone()
        moe.experts.w13_packed[0].bitwise_xor_(0x11)  # rewrite expert 0's gate/up codes in place
        assert not torch.equal(moe.experts.dequantized()[0], before)
        torch.testing.assert_close(moe(x), _reference(moe, x), atol=1e-5, rtol=1e-5)
    assert packed.shape == (num_tokens, SHAPE.latent_size)


def test_decoded_cache_is_skipped_above_its_budget(monkeypatch) -> None:
    """Experts whose float32 copy exceeds DEQUANT_CACHE_MAX_BYTES are not decoded whole (the per-expert path runs)."""
    from engine.layers import mxfp4

    moe = _filled(SHAPE, seed=13)
    monkeypatch.setattr(mxfp4, "DEQUANT_CACHE_MAX_BYTES", 1024)
    assert moe.experts.dequantized() is None
    x = torch.randn(3, SHAPE.hidden_size, generator=torch.Generator().manual_seed(14))
    with torch.no_grad():
        torch.testing.assert_close(moe(x), _reference(moe, x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rank", [0, 1])
def test_device_path_equals_the_grouped_path(rank: int) -> None:
    """The GPU path (every local expert over every token, weighted; no nonzero, no .tolist(): graph
    capturable) gives the grouped path's sum (1e-5), for each rank's shard of the experts."""
    from engine.layers.latent_moe import run_packed_experts, run_packed_experts_on_device

    full = _filled(SHAPE, seed=21)
    shard = LatentMoE(SHAPE, TPGroup(rank, 2), torch.float32)
    for name, buffer in shard.experts.named_buffers():
        buffer.copy_(getattr(full.experts, name)[rank * 4 : rank * 4 + 4])
    u = torch.randn(7, SHAPE.latent_size, generator=torch.Generator().manual_seed(22))
    weights, ids = full.gate(torch.randn(7, SHAPE.hidden_size, generator=torch.Generator().manual_seed(23)))
    with torch.no_grad():
        grouped = run_packed_experts(shard.experts, shard.expert_start, u, weights, ids, 4.0, 25.0)
        on_device = run_packed_experts_on_device(shard.experts, shard.expert_start, u, weights, ids, 4.0, 25.0)
    torch.testing.assert_close(on_device, grouped, atol=1e-5, rtol=1e-5)
