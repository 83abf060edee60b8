"""DSpark variants (K3_SPEC 5.2): the MLA-layer draft (KimiK3DSparkMLADraftModel: K3 MLA attention with
interleaved YaRN RoPE, a 576-style latent context cache) and the gated / rnn Markov heads - loaded from the
published layout, computing what the spec says, and exact inside the engine (greedy spec == plain greedy)."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.layers.rotary import RotaryEmbedding
from engine.models.draft_registry import load_any_draft, read_any_draft_config
from engine.models.dspark import DSparkDraft, load_dspark
from engine.models.dspark_markov import GatedMarkovHead, RnnMarkovHead, build_markov_head
from engine.models.dspark_mla import DSparkMLALayer
from tests.engine.dspark_fixtures import TINY_MLA, YARN, add_random_dspark, make_k3_with_dspark
from tests.engine.k3_checkpoint import make_k3_checkpoint

MLA_NAMES = ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj")


@pytest.fixture()
def mla_dir(tmp_path):
    target = make_k3_checkpoint(tmp_path, "k3")
    return add_random_dspark(target, gamma=5, seed=2, mla=TINY_MLA, markov_kind="rnn")


def test_mla_variant_loads_from_its_published_layout(mla_dir):
    """The MLA draft's config names its architecture; its tensors carry the K3 MLA names under self_attn; it
    loads back (through the registry) to the same function; a missing tensor is named; its context cache row
    is kv_lora_rank + rope wide."""
    config = read_any_draft_config(mla_dir)
    assert config.mla == TINY_MLA and config.markov_kind == "rnn" and config.draft_dim == 16 + 8
    tensors = load_file(str(mla_dir / "model.safetensors"))
    for name in MLA_NAMES:
        assert f"layers.1.self_attn.{name}.weight" in tensors
    assert "markov_head.joint_proj.bias" in tensors and not any(".k_norm." in n for n in tensors)
    draft = load_any_draft(mla_dir, torch.float32, "cpu")
    assert isinstance(draft, DSparkDraft) and all(isinstance(layer, DSparkMLALayer) for layer in draft.layers)
    again = load_dspark(mla_dir)
    captured = torch.randn(2, 5, 3 * 64)
    context = draft.context_entries(captured, torch.arange(5).expand(2, 5))
    assert context.shape == (2, 2, 5, 24)
    embeds, positions, lens = torch.randn(2, 4, 64), torch.arange(4).expand(2, 4) + 5, torch.tensor([5, 3])
    assert torch.equal(draft(embeds, positions, context, lens), again(embeds, positions, context, lens))
    del tensors["layers.1.self_attn.kv_b_proj.weight"]
    save_file(tensors, str(mla_dir / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing tensors \['layers\.1\.self_attn\.kv_b_proj\.weight'\]"):
        load_dspark(mla_dir)


def test_mla_context_rope_is_the_target_engines_interleaved_rope(mla_dir):
    """A context row is [kv_a_layernorm(c_kv) | RoPE(k_pe)] with the target engine's own interleaved YaRN RoPE
    (engine/layers/rotary.py) at the token's position."""
    draft = load_dspark(mla_dir)
    layer, feature, positions = draft.layers[0], torch.randn(6, 64), torch.tensor([0, 3, 17, 40, 63, 200])
    cos, sin = draft._rope(positions, torch.float32)
    rows = layer.context_entry(feature, cos, sin)
    latent, k_pe = layer.kv_a_proj_with_mqa(feature).split([16, 8], -1)
    rotary = RotaryEmbedding(YARN, 8, interleave=True)
    _, expected_pe = rotary(positions, torch.zeros(6, 1, 8), k_pe)
    torch.testing.assert_close(rows[:, :16], layer.kv_a_layernorm(latent))
    torch.testing.assert_close(rows[:, 16:], expected_pe, rtol=1e-5, atol=1e-6)


def test_mla_attention_equals_a_per_head_loop(mla_dir):
    """One MLA draft layer's attention equals an explicit per-head softmax over the visible [context ; block]
    rows (keys [k_nope | k_pe], values from kv_b_proj, scale qk_head_dim^-1/2), followed by o_proj and the MLP."""
    draft = load_dspark(mla_dir)
    layer = draft.layers[0]
    torch.manual_seed(3)
    hidden, positions = torch.randn(1, 3, 64), torch.tensor([[7, 8, 9]])
    context = draft.context_entries(torch.randn(1, 7, 3 * 64), torch.arange(7)[None])[0]
    mask = torch.ones(1, 3, 7 + 3, dtype=torch.bool)
    mask[0, :, 5:7] = False  # two padding context rows
    cos, sin = draft._rope(positions, torch.float32)
    with torch.no_grad():
        got = layer(hidden, cos, sin, context, mask)
        x = layer.input_norm(hidden)[0]
        q = layer.q_b_proj(layer.q_a_layernorm(layer.q_a_proj(x))).view(3, 4, 16)
        rows = torch.cat((context[0], layer.context_entry(x[None], cos, sin)[0]))
        keys_values = layer.kv_b_proj(rows[:, :16]).view(10, 4, 16)
        from engine.models.dspark_mla import rotate

        q_pe = rotate(q[..., 8:], cos[0][:, None], sin[0][:, None], True)
        out = torch.zeros(3, 4, 8)
        for h in range(4):
            keys = torch.cat((keys_values[:, h, :8], rows[:, 16:]), dim=-1)
            scores = (torch.cat((q[:, h, :8], q_pe[:, h]), -1) @ keys.T) / math.sqrt(16)
            scores = scores.masked_fill(~mask[0], float("-inf"))
            out[:, h] = torch.softmax(scores, -1) @ keys_values[:, h, 8:]
        after = hidden[0] + layer.o_proj(out.reshape(3, 32))
        m = layer.post_attention_norm(after)
        expected = after + layer.down_proj(torch.nn.functional.silu(layer.gate_proj(m)) * layer.up_proj(m))
    torch.testing.assert_close(got[0], expected, rtol=1e-5, atol=1e-5)


def test_mla_training_path_matches_inference(mla_dir):
    """forward_anchors (many blocks, masked) == forward over the context rows before each anchor."""
    draft = load_dspark(mla_dir)
    torch.manual_seed(1)
    captured, anchors, b = torch.randn(1, 12, 3 * 64), torch.tensor([[2, 9]]), 5
    embeds = torch.randn(1, 2, b, 64)
    with torch.no_grad():
        batched = draft.forward_anchors(captured, embeds, anchors)
        for k, anchor in enumerate(anchors[0].tolist()):
            context = draft.context_entries(captured[0, :anchor], torch.arange(anchor))
            single = draft(embeds[0, k][None], (anchor + torch.arange(b))[None], context[:, None], torch.tensor([anchor]))
            torch.testing.assert_close(single[0], batched[0, k], rtol=1e-4, atol=1e-5)


def test_gated_and_rnn_markov_heads_follow_the_spec():
    """gated: bias = W2(sigmoid(gate_proj[h; E[prev]]) * E[prev]); rnn: s' = g s + (1 - g) tanh(c),
    bias = W2 tanh(o) with (g | c | o) = joint_proj[s; E[prev]; h], s_0 = 0 - the state carries across slots;
    an unknown kind is refused and a hidden-reading head without hidden states is an error."""
    torch.manual_seed(0)
    vocab, rank, hidden_size, n = 11, 4, 6, 3
    hidden, prev = torch.randn(n, 2, hidden_size), [torch.tensor([1, 5, 7]), torch.tensor([2, 2, 9])]
    gated = build_markov_head("gated", vocab, rank, hidden_size)
    assert isinstance(gated, GatedMarkovHead)
    steps = gated.steps(hidden)
    e = gated.markov_w1(prev[0])
    expected = gated.markov_w2(torch.sigmoid(gated.gate_proj(torch.cat((hidden[:, 0], e), -1))) * e)
    torch.testing.assert_close(steps(prev[0]), expected)
    rnn = build_markov_head("rnn", vocab, rank, hidden_size)
    assert isinstance(rnn, RnnMarkovHead)
    steps, state = rnn.steps(hidden), torch.zeros(n, rank)
    for k in range(2):
        e = rnn.markov_w1(prev[k])
        a, c, o = rnn.joint_proj(torch.cat((state, e, hidden[:, k]), -1)).chunk(3, -1)
        torch.testing.assert_close(steps(prev[k]), rnn.markov_w2(torch.tanh(o)))
        state = torch.sigmoid(a) * state + (1 - torch.sigmoid(a)) * torch.tanh(c)
    fresh = rnn.steps(hidden[:, 1:])  # slot 1's inputs with a zero state: a different bias
    assert not torch.allclose(fresh(prev[1]), rnn.markov_w2(torch.tanh(o)))
    with pytest.raises(ValueError, match="markov_head_type 'lstm'"):
        build_markov_head("lstm", vocab, rank, hidden_size)
    with pytest.raises(ValueError, match="needs the draft's hidden states"):
        rnn.steps(None)


GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [[5 + i % 7, 6 + i, 7, 8 + (3 * i) % 11] * (1 + i % 4) for i in range(4)]
VARIANTS = {"mla+vanilla": (TINY_MLA, "vanilla"), "dense+gated": (None, "gated"), "mla+rnn": (TINY_MLA, "rnn")}


def _check_greedy_spec(model_dir, prompts, blocks) -> None:
    with LLM(str(model_dir), attention_backend="torch", spec_block_size=8, num_threads=1) as llm:
        plain = llm.generate(prompts, dataclasses.replace(GREEDY, speculative=False))
        for block in blocks:
            assert llm.generate(prompts, dataclasses.replace(GREEDY, block_size=block)) == plain, f"block {block}"
        assert [llm.generate([p], dataclasses.replace(GREEDY, block_size=blocks[-1]))[0] for p in prompts[:2]] \
            == plain[:2]
        assert llm.acceptance_stats.num_verify_steps > 0
        assert llm.engine.state_pool.num_free == llm.engine.state_pool.num_slots


@pytest.mark.slow
def test_greedy_spec_with_mla_rnn_draft_equals_plain(tmp_path):
    """With the MLA-layer draft and an rnn Markov head, greedy speculation (block 6, batched and alone) emits
    exactly the plain greedy tokens on a tiny K3."""
    _check_greedy_spec(make_k3_with_dspark(tmp_path, mla=TINY_MLA, markov_kind="rnn"), PROMPTS[:3], (6,))


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_spec_equals_plain_for_every_variant(tmp_path, variant):
    """Each draft variant (MLA layers, gated and rnn Markov heads): greedy spec decoding with blocks 2, 4 and 8
    emits exactly plain greedy's tokens."""
    mla, kind = VARIANTS[variant]
    _check_greedy_spec(make_k3_with_dspark(tmp_path, mla=mla, markov_kind=kind), PROMPTS, (2, 4, 8))
