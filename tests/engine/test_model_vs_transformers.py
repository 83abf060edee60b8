"""The engine's DeepSeek-V3 matches transformers' DeepseekV3ForCausalLM (eager, float32) on tiny random
checkpoints, in every way the serving system drives it: fresh prefill, batched prompts, chunked
prefill over a cached prefix, absorbed decode (one and several tokens per step), captured layers."""
from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV3ForCausalLM as HFDeepseekV3
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding, DeepseekV3TopkRouter

from engine.attention.base import VarlenSpans
from engine.attention.torch_backend import TorchAttentionBackend
from engine.model_configs.model_config import ModelConfig, RopeConfig
from engine.runtime.distributed import TPGroup
from engine.runtime.forward_batch import ForwardMode
from engine.layers.moe import select_experts
from engine.layers.rotary import RotaryEmbedding
from engine.models.deepseek_v3 import load_model
from tests.engine.tiny_models import VARIANTS, PagedRunner

TOL = 1e-4
EXTEND, DECODE = ForwardMode.EXTEND, ForwardMode.DECODE


def _prompt(length: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=VARIANTS)
def models(request: pytest.FixtureRequest, tiny_checkpoint):
    """(variant, engine config, engine model, transformers model) for one tiny checkpoint."""
    path = tiny_checkpoint(request.param)
    config, model = load_model(path, TPGroup(), TorchAttentionBackend(), torch.float32)
    reference = HFDeepseekV3.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()
    return request.param, config, model, reference


def _reference(reference, tokens: list[int]):
    with torch.no_grad():
        return reference(torch.tensor([tokens]), output_hidden_states=True)


def test_prefill_logits_and_captured_layers_match_transformers(models) -> None:
    """Fresh EXTEND over a whole prompt: logits within 1e-4; captured layer L equals hidden_states[L+1]."""
    _, config, model, reference = models
    tokens = _prompt(37, config.vocab_size, seed=1)
    layers = tuple(range(config.num_hidden_layers - 1))
    logits, out = PagedRunner(model, config).step(EXTEND, [(0, tokens)], capture_layers=layers)
    expected = _reference(reference, tokens)
    assert logits.dtype == torch.float32 and logits.shape == (37, config.vocab_size)
    torch.testing.assert_close(logits, expected.logits[0], atol=TOL, rtol=0)
    assert len(out.captured) == len(layers)
    for layer, captured in zip(layers, out.captured):
        torch.testing.assert_close(captured, expected.hidden_states[layer + 1][0], atol=TOL, rtol=0)
    torch.testing.assert_close(out.hidden, expected.hidden_states[-1][0], atol=TOL, rtol=0)


def test_batched_prompts_equal_separate_runs(models) -> None:
    """Several prompts of different lengths in one EXTEND forward give each prompt's solo logits."""
    _, config, model, reference = models
    prompts = [_prompt(n, config.vocab_size, seed=n) for n in (5, 19, 33)]
    batched, _ = PagedRunner(model, config).step(EXTEND, list(enumerate(prompts)))
    start = 0
    for seq, prompt in enumerate(prompts):
        alone, _ = PagedRunner(model, config).step(EXTEND, [(seq, prompt)])
        torch.testing.assert_close(batched[start : start + len(prompt)], alone, atol=1e-5, rtol=0)
        torch.testing.assert_close(alone, _reference(reference, prompt).logits[0], atol=TOL, rtol=0)
        start += len(prompt)


def test_chunked_prefill_equals_one_shot(models) -> None:
    """EXTEND over a cached prefix (two chunks, crossing a page boundary) equals a one-shot prefill."""
    _, config, model, _ = models
    tokens = _prompt(41, config.vocab_size, seed=2)
    one_shot, _ = PagedRunner(model, config).step(EXTEND, [(0, tokens)])
    runner = PagedRunner(model, config)
    other = _prompt(9, config.vocab_size, seed=3)
    first, _ = runner.step(EXTEND, [(0, tokens[:21]), (1, other)])
    second, _ = runner.step(EXTEND, [(1, [5, 6]), (0, tokens[21:])])
    chunked = torch.cat([first[:21], second[2:]])
    torch.testing.assert_close(chunked, one_shot, atol=TOL, rtol=0)


def test_absorbed_decode_matches_full_prompt_logits(models) -> None:
    """DECODE (absorbed MLA over the latent cache), one token and then several tokens per step,
    reproduces transformers' full-prompt logits at every position."""
    _, config, model, reference = models
    tokens = _prompt(30, config.vocab_size, seed=4)
    expected = _reference(reference, tokens).logits[0]
    runner = PagedRunner(model, config)
    prefix, _ = runner.step(EXTEND, [(0, tokens[:17])])
    pieces = [prefix]
    for position in range(17, 22):
        logits, _ = runner.step(DECODE, [(0, tokens[position : position + 1])])
        pieces.append(logits)
    logits, _ = runner.step(DECODE, [(0, tokens[22:26])])  # a speculative-verify-shaped step
    pieces.append(logits)
    logits, _ = runner.step(DECODE, [(0, tokens[26:])])
    pieces.append(logits)
    torch.testing.assert_close(torch.cat(pieces), expected, atol=TOL, rtol=0)


def test_decode_batch_of_sequences_matches_transformers(models) -> None:
    """One DECODE step carrying several sequences with different context and query lengths."""
    _, config, model, reference = models
    prompts = [_prompt(n, config.vocab_size, seed=10 + n) for n in (12, 20, 7)]
    runner = PagedRunner(model, config)
    runner.step(EXTEND, [(i, p[:-3]) for i, p in enumerate(prompts)])
    logits, _ = runner.step(DECODE, [(0, prompts[0][-3:-2]), (1, prompts[1][-3:]), (2, prompts[2][-3:-1])])
    expected = torch.cat([
        _reference(reference, prompts[0][:-2]).logits[0, -1:],
        _reference(reference, prompts[1]).logits[0, -3:],
        _reference(reference, prompts[2][:-1]).logits[0, -2:],
    ])
    torch.testing.assert_close(logits, expected, atol=TOL, rtol=0)


def test_correction_bias_steers_selection(tiny_checkpoint) -> None:
    """The router's e_score_correction_bias matters: zeroing it in the engine breaks the match."""
    path = tiny_checkpoint("grouped")
    config, model = load_model(path, TPGroup(), TorchAttentionBackend(), torch.float32)
    tokens = _prompt(40, config.vocab_size, seed=5)
    with_bias, _ = PagedRunner(model, config).step(EXTEND, [(0, tokens)])
    for layer in model.model.layers:
        if config.is_moe_layer(layer.self_attn.layer_index):
            layer.mlp.gate.e_score_correction_bias.zero_()
    without_bias, _ = PagedRunner(model, config).step(EXTEND, [(0, tokens)])
    assert (with_bias - without_bias).abs().max() > 1e-3


@pytest.mark.parametrize("rope", [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
     "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 8.0, "original_max_position_embeddings": 512,
     "beta_fast": 16, "beta_slow": 2, "mscale": 0.9, "mscale_all_dim": 0.6},
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 256},
])
def test_rotary_matches_transformers(rope: dict) -> None:
    """inv_freq and the cos/sin scaling equal transformers' for default and yarn rope."""
    from transformers import DeepseekV3Config

    hf_config = DeepseekV3Config(qk_rope_head_dim=64, max_position_embeddings=163840, rope_parameters=dict(rope))
    reference = DeepseekV3RotaryEmbedding(hf_config)
    ours = RotaryEmbedding(RopeConfig.from_hf(dict(rope), 10000.0, 163840), 64, interleave=True)
    torch.testing.assert_close(ours.inv_freq, reference.inv_freq, atol=0, rtol=0)
    assert ours.scaling == pytest.approx(reference.attention_scaling, rel=1e-12)


def test_router_matches_transformers() -> None:
    """select_experts picks the same experts with the same weights as DeepseekV3TopkRouter (groups + bias)."""
    from transformers import DeepseekV3Config

    hf_config = DeepseekV3Config(hidden_size=32, n_routed_experts=32, num_experts_per_tok=6, n_group=8, topk_group=3,
                                 routed_scaling_factor=2.5, norm_topk_prob=True)
    router = DeepseekV3TopkRouter(hf_config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(32, 32, generator=generator))
        router.e_score_correction_bias.copy_(torch.randn(32, generator=generator) * 0.3)
    x = torch.randn(50, 32, generator=generator)
    _, ref_weights, ref_ids = router(x)
    weights, ids = select_experts(x @ router.weight.T, router.e_score_correction_bias, 6, 8, 3, "noaux_tc",
                                  "sigmoid", True, 2.5)
    order, ref_order = ids.sort(dim=-1), ref_ids.sort(dim=-1)
    assert torch.equal(order.values, ref_order.values)
    torch.testing.assert_close(weights.gather(1, order.indices), ref_weights.gather(1, ref_order.indices))


def test_greedy_softmax_router_is_plain_top_k() -> None:
    """topk_method=greedy with softmax scoring: the k largest softmax probabilities, renormalised."""
    logits = torch.randn(20, 12, generator=torch.Generator().manual_seed(1))
    weights, ids = select_experts(logits, None, 3, 1, 1, "greedy", "softmax", True, 1.0)
    probs = logits.softmax(-1)
    expected = probs.topk(3, dim=-1)
    assert torch.equal(ids.sort(-1).values, expected.indices.sort(-1).values)
    torch.testing.assert_close(weights.sum(-1), torch.ones(20))
    torch.testing.assert_close(weights.sort(-1).values, (expected.values / expected.values.sum(-1, keepdim=True)).sort(-1).values)


def test_softmax_scale_matches_transformers(tiny_checkpoint) -> None:
    """ModelConfig.softmax_scale equals transformers' DeepseekV3Attention.scaling (yarn mscale_all_dim)."""
    path = tiny_checkpoint("yarn")
    reference = HFDeepseekV3.from_pretrained(path, attn_implementation="eager", dtype=torch.float32)
    config = ModelConfig.from_pretrained(path)
    assert config.softmax_scale == pytest.approx(reference.model.layers[0].self_attn.scaling, rel=1e-12)
    assert config.softmax_scale != pytest.approx(config.qk_head_dim ** -0.5)


def test_bfloat16_model_tracks_float32(models, tiny_checkpoint) -> None:
    """A bfloat16 model with a bfloat16 cache (prefill then absorbed decode) returns float32 logits close
    to the float32 model's (mean error well under bf16 noise of a routing flip)."""
    variant, config, model, _ = models
    _, model_bf16 = load_model(tiny_checkpoint(variant), TPGroup(), TorchAttentionBackend(), torch.bfloat16)
    tokens = _prompt(40, config.vocab_size, seed=6)
    expected, _ = PagedRunner(model, config).step(EXTEND, [(0, tokens)])
    runner = PagedRunner(model_bf16, config)
    assert runner.cache.kv.dtype == torch.bfloat16
    prefill, _ = runner.step(EXTEND, [(0, tokens[:30])])
    decode, _ = runner.step(DECODE, [(0, tokens[30:])])
    got = torch.cat([prefill, decode])
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    assert (got - expected).abs().mean() < 0.03


@pytest.mark.parametrize("score_budget", [None, 40])
def test_torch_backend_prefill_matches_sdpa(score_budget: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reference prefill (also when split into query blocks) equals SDPA with a bottom-right causal mask."""
    import engine.attention.torch_backend as torch_backend

    if score_budget is not None:
        monkeypatch.setattr(torch_backend, "_SCORE_BUDGET", score_budget)
    generator = torch.Generator().manual_seed(3)
    q_lens, k_lens = (3, 9), (7, 9)
    q = torch.randn(sum(q_lens), 2, 12, generator=generator)
    k = torch.randn(sum(k_lens), 2, 12, generator=generator)
    v = torch.randn(sum(k_lens), 2, 8, generator=generator)
    out = TorchAttentionBackend().prefill(q, k, v, VarlenSpans.from_lens(q_lens, k_lens), 0.3)
    q_start = k_start = 0
    for q_len, k_len in zip(q_lens, k_lens):
        mask = torch.ones(q_len, k_len, dtype=torch.bool).tril(k_len - q_len)
        expected = torch.nn.functional.scaled_dot_product_attention(
            q[q_start : q_start + q_len].transpose(0, 1), k[k_start : k_start + k_len].transpose(0, 1),
            v[k_start : k_start + k_len].transpose(0, 1), attn_mask=mask, scale=0.3).transpose(0, 1)
        torch.testing.assert_close(out[q_start : q_start + q_len], expected, atol=1e-5, rtol=0)
        q_start, k_start = q_start + q_len, k_start + k_len
