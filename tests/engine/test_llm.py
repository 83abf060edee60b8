"""The offline LLM API against transformers (the reference), and the engine's batching invariants."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.engine.tiny_models import VARIANTS, make_tiny_checkpoint

PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27], [3] * 37]
GREEDY = SamplingParams(max_new_tokens=64, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {variant: make_tiny_checkpoint(root / variant, variant) for variant in VARIANTS}


def _reference_greedy(model_dir, prompts, max_new_tokens):
    from transformers import DeepseekV3ForCausalLM

    model = DeepseekV3ForCausalLM.from_pretrained(str(model_dir), attn_implementation="eager").eval()
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = model.generate(
                torch.tensor([prompt]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                do_sample=False, eos_token_id=None, pad_token_id=0,
            )
            outputs.append(ids[0, len(prompt):].tolist())
    logits = model(torch.tensor([PROMPTS[1]])).logits[0]
    return outputs, logits


@pytest.mark.slow  # transformers generate() of 3 x 64 tokens per variant: ~7 s of CPU (test_model_vs_transformers
# checks the logits of every variant in the fast loop)
@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_and_greedy_match_transformers(checkpoints, variant):
    """llm.logits is within 1e-4 of DeepseekV3ForCausalLM and greedy generate of 64 tokens is token-identical."""
    expected, ref_logits = _reference_greedy(checkpoints[variant], PROMPTS, 64)
    with LLM(str(checkpoints[variant]), attention_backend="torch", draft_model="") as llm:
        logits = llm.logits(PROMPTS[1])
        assert (logits - ref_logits).abs().max().item() < 1e-4
        assert llm.generate(PROMPTS, GREEDY) == expected


@pytest.mark.slow  # TP: two ranks, gloo
def test_tp2_equals_tp1(checkpoints):
    """TP=2 (two processes, gloo) gives the TP=1 logits within 1e-4 and identical greedy generations."""
    model_dir = str(checkpoints["heads24"])
    with LLM(model_dir, attention_backend="torch", draft_model="") as llm:
        logits1, out1 = llm.logits(PROMPTS[1]), llm.generate(PROMPTS, GREEDY)
    with LLM(model_dir, tp_size=2, attention_backend="torch", draft_model="") as llm:
        logits2, out2 = llm.logits(PROMPTS[1]), llm.generate(PROMPTS, GREEDY)
    assert (logits1 - logits2).abs().max().item() < 1e-4
    assert out1 == out2


def test_chunked_prefill_and_preemption_do_not_change_outputs(checkpoints):
    """Small prefill chunks, few running slots and a pool so small that sequences get preempted (counted)
    and recomputed all produce the same greedy tokens as an unconstrained engine."""
    model_dir = str(checkpoints["yarn"])
    prompts = [list(range(2, 2 + n)) for n in (3, 30, 17, 45, 8, 21)]
    params = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    with LLM(model_dir, attention_backend="torch", draft_model="") as llm:
        expected = llm.generate(prompts, params)
    page_bytes = 3 * 4 * (32 + 8) * 4  # layers x page_size x latent entry x float32
    with LLM(model_dir, attention_backend="torch", draft_model="", max_batched_tokens=7, max_running=3,
             page_size=4, kv_memory_bytes=page_bytes * 30) as llm:
        assert llm.engine.allocator.num_pages == 30  # three long sequences need more: preemption happens
        assert llm.generate(prompts, params) == expected
        assert llm.engine.num_preemptions > 0  # (the outputs above went through preemption and recompute)
        assert llm.engine.num_free_pages == llm.engine.allocator.num_pages


def test_seeded_sampling_is_reproducible_whatever_the_batch(checkpoints):
    """A seeded request samples the same tokens alone and inside a batch of other requests."""
    model_dir = str(checkpoints["grouped"])
    seeded = SamplingParams(max_new_tokens=12, temperature=0.9, top_k=50, top_p=0.9, seed=1234, ignore_eos=True)
    other = SamplingParams(max_new_tokens=12, temperature=1.0, ignore_eos=True)
    with LLM(model_dir, attention_backend="torch", draft_model="") as llm:
        alone = llm.generate([PROMPTS[0]], seeded)[0]
        batch = llm.generate([PROMPTS[1], PROMPTS[0], PROMPTS[2]], [other, seeded, other])
    assert batch[1] == alone


def _with_eos(model_dir, eos_token_id: int, destination):
    """A copy of the checkpoint whose config names eos_token_id as its end of sequence (weights unchanged)."""
    import json
    import shutil

    shutil.copytree(model_dir, destination)
    config = json.loads((destination / "config.json").read_text())
    config["eos_token_id"] = eos_token_id
    (destination / "config.json").write_text(json.dumps(config))
    return str(destination)


def test_stop_conditions(checkpoints, tmp_path):
    """Generation stops at the model's eos (unless ignore_eos), at a stop token id, and at max_new_tokens.
    The eos case uses a copy of the model whose eos id is a token greedy decoding emits at step 6."""
    model_dir = str(checkpoints["yarn"])
    with LLM(model_dir, attention_backend="torch", draft_model="") as llm:
        free = llm.generate([PROMPTS[1]], SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True))[0]
        stop_at = free[5]
        first = free.index(stop_at)
        stopped = llm.generate([PROMPTS[1]], SamplingParams(max_new_tokens=30, temperature=0.0, stop_token_ids=(stop_at,)))[0]
        assert stopped == free[: first + 1]
        assert len(llm.generate([PROMPTS[1]], SamplingParams(max_new_tokens=3, temperature=0.0))[0]) == 3
    with LLM(_with_eos(checkpoints["yarn"], stop_at, tmp_path / "eos"), attention_backend="torch", draft_model="") as llm:
        assert llm.engine.eos_ids == {stop_at}
        at_eos = llm.generate([PROMPTS[1]], SamplingParams(max_new_tokens=30, temperature=0.0))[0]
        past_eos = llm.generate([PROMPTS[1]], SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True))[0]
    assert at_eos == free[: first + 1] and len(at_eos) < 30
    assert past_eos == free


@pytest.mark.parametrize(
    "prompt, message",
    [([], "empty"), ([5, 100000], "out of the vocabulary"), ([-1], "out of the vocabulary"),
     ([3, 2.0], "out of the vocabulary"), ([4] * 600, "max_position_embeddings")],
)
def test_bad_input_is_a_clear_value_error(checkpoints, prompt, message):
    """Out-of-vocab ids, empty prompts and prompts beyond max_position_embeddings raise ValueError saying so."""
    with LLM(str(checkpoints["yarn"]), attention_backend="torch", draft_model="") as llm:
        with pytest.raises(ValueError, match=message):
            llm.generate([prompt], SamplingParams(max_new_tokens=4))
        with pytest.raises(ValueError, match=message):
            llm.logits(prompt)


def test_bad_config_is_a_clear_value_error(tmp_path, checkpoints):
    """A config.json with an unsupported value fails LLM construction with a ValueError naming the field."""
    import json
    import shutil

    model_dir = tmp_path / "bad"
    shutil.copytree(checkpoints["yarn"], model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["hidden_act"] = "gelu"
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="hidden_act"):
        LLM(str(model_dir), attention_backend="torch", draft_model="")
    with pytest.raises(ValueError, match="config.json"):
        LLM(str(tmp_path / "missing"))
