"""Penalties, logit_bias and min_tokens (engine/sampling/penalties.py) against a per-row Python reference of the
formulas (vLLM / OpenAI semantics), and in the engine: a banned token never appears, min_tokens holds eos
back, penalties change greedy output as the formula says, and speculative decoding leaves greedy output
with penalties token-identical."""
from __future__ import annotations

import math
import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.sampling.penalties import RowContext, adjust_logits

EOS = (1,)


def reference_adjust(logits: list[float], params: SamplingParams, prompt: list[int], output: list[int],
                     eos_ids: tuple[int, ...] = EOS) -> list[float]:
    """The formulas, one token at a time: logit_bias (-100: ban) and min_tokens bans, then repetition over
    prompt + output (divide positive, multiply negative), then frequency * count and presence."""
    row = list(logits)
    for token, bias in params.logit_bias:
        row[token] = -math.inf if bias <= -100 else row[token] + bias
    if len(output) < params.min_tokens:
        for token in set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids)):
            row[token] = -math.inf
    for token in range(len(row)):
        count = output.count(token)
        if token in prompt or count:
            r = params.repetition_penalty
            row[token] = row[token] / r if row[token] > 0 else row[token] * r
        row[token] -= params.frequency_penalty * count + params.presence_penalty * (count > 0)
    return row


def _random_params(rng: random.Random, vocab: int) -> SamplingParams:
    bias = {token: rng.choice([-100.0, -3.5, 0.0, 2.25, 100.0]) for token in rng.sample(range(vocab), rng.randint(0, 3))}
    return SamplingParams(
        max_new_tokens=8, presence_penalty=rng.choice([0.0, 0.5, -1.0, 2.0]),
        frequency_penalty=rng.choice([0.0, 0.3, -0.7, 2.0]), repetition_penalty=rng.choice([1.0, 1.3, 0.8, 2.0]),
        logit_bias=bias, min_tokens=rng.choice([0, 0, 2, 8]), stop_token_ids=tuple(rng.sample(range(vocab), rng.randint(0, 2))),
        ignore_eos=rng.random() < 0.3)


def test_adjust_logits_matches_the_reference_formulas() -> None:
    """Random rows (logits of both signs, repeated tokens in prompt and output, every setting mixed, rows without
    adjustments in between): adjust_logits equals the per-token reference to float32 rounding, and leaves
    unadjusted rows bit-identical."""
    rng = random.Random(0)
    vocab = 12
    for _ in range(40):
        num_rows = rng.randint(1, 6)
        logits = torch.randn(num_rows, vocab) * 4
        rows, expected = [], []
        for r in range(num_rows):
            if rng.random() < 0.25:
                rows.append(None)
                expected.append(logits[r].tolist())
                continue
            params = _random_params(rng, vocab)
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 6))]
            output = [rng.randrange(vocab) for _ in range(rng.randint(0, 9))]
            rows.append(RowContext(params, prompt, output))
            expected.append(reference_adjust(logits[r].tolist(), params, prompt, output))
        got = adjust_logits(logits, rows, EOS)
        assert torch.allclose(got, torch.tensor(expected), atol=1e-5, equal_nan=False), (got, expected)
        for r, row in enumerate(rows):
            if row is None:
                assert torch.equal(got[r], logits[r])


def test_no_adjustment_returns_the_logits_themselves() -> None:
    """Rows without settings cost nothing: the same tensor object comes back."""
    logits = torch.randn(3, 8)
    rows = [RowContext(SamplingParams(), [1, 2], [3]), None, RowContext(SamplingParams(temperature=0), [1], [])]
    assert adjust_logits(logits, rows, EOS) is logits


@pytest.mark.parametrize("field, value", [
    ("presence_penalty", 2.5), ("frequency_penalty", -2.1), ("repetition_penalty", 0.0),
    ("logit_bias", {3: 101}), ("logit_bias", {-1: 1.0}), ("logit_bias", {"a": 1.0}), ("min_tokens", 17),
])
def test_invalid_settings_name_the_field(field: str, value: object) -> None:
    """Out-of-range penalties, biases and min_tokens raise ValueError naming the field."""
    with pytest.raises(ValueError, match=field):
        SamplingParams(max_new_tokens=16, **{field: value})


@pytest.fixture(scope="module")
def tiny_llm(tiny_checkpoint):
    with LLM(str(tiny_checkpoint("heads24")), attention_backend="torch", draft_model="") as llm:
        yield llm


PROMPT = [5, 9, 7, 5, 9, 7, 5]


def test_banned_token_never_appears(tiny_llm) -> None:
    """logit_bias -100 on the tokens greedy decoding emits most: over 64 sampled tokens at temperature 1.5 and
    a greedy run none of them appears, while without the ban they do."""
    free = tiny_llm.generate([PROMPT], SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True))[0]
    banned = sorted(set(free))[:4]
    bias = {token: -100.0 for token in banned}
    greedy = tiny_llm.generate([PROMPT], SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True,
                                                        logit_bias=bias))[0]
    sampled = tiny_llm.generate([PROMPT] * 4, SamplingParams(max_new_tokens=16, temperature=1.5, ignore_eos=True,
                                                             logit_bias=bias, seed=3))
    assert any(token in banned for token in free)
    assert not set(greedy) & set(banned)
    assert not any(set(out) & set(banned) for out in sampled)


def test_min_tokens_holds_back_stop_tokens(tiny_llm) -> None:
    """A stop token id that greedy decoding emits first stops it at once; with min_tokens 6 it cannot come before
    the sixth token (the request then ends on it or at max_new_tokens)."""
    first = tiny_llm.generate([PROMPT], SamplingParams(max_new_tokens=1, temperature=0))[0][0]
    stopped = tiny_llm.generate([PROMPT], SamplingParams(max_new_tokens=12, temperature=0, stop_token_ids=(first,)))[0]
    held = tiny_llm.generate([PROMPT], SamplingParams(max_new_tokens=12, temperature=0, stop_token_ids=(first,),
                                                      min_tokens=6))[0]
    assert stopped == [first]
    assert len(held) >= 6 and first not in held[:5]


def test_greedy_penalties_follow_the_formula(tiny_llm) -> None:
    """Greedy decoding with penalties emits, at every step, the argmax of the reference-adjusted logits of the
    raw model (llm.logits over the prompt + tokens so far)."""
    params = SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True, presence_penalty=0.7,
                            frequency_penalty=0.9, repetition_penalty=1.6, logit_bias={4: 3.0, 8: -2.0})
    out = tiny_llm.generate([PROMPT], params)[0]
    plain = tiny_llm.generate([PROMPT], SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True))[0]
    for step, token in enumerate(out):
        logits = tiny_llm.logits(PROMPT + out[:step])[-1].tolist()
        adjusted = reference_adjust(logits, params, PROMPT, out[:step], tuple(tiny_llm.model_config.eos_token_id))
        assert token == max(range(len(adjusted)), key=lambda t: (adjusted[t], -t))
    assert out != plain


def test_greedy_penalties_are_identical_under_speculation(tiny_checkpoint, tmp_path) -> None:
    """With a random draft (rarely right, so verify blocks mix accepted and rejected drafts), greedy decoding with
    penalties and a ban is token-identical with speculation on and off: each verify row saw the penalties of the
    drafts before it."""
    from tests.engine.spec_fixtures import add_random_draft
    import shutil

    path = tmp_path / "m"
    shutil.copytree(tiny_checkpoint("heads24"), path)
    add_random_draft(path, block_size=4)
    prompts = [[5 + i % 7, 6 + i, 7, 8 + (3 * i) % 11] * (1 + i % 3) for i in range(6)]
    params = dict(max_new_tokens=16, temperature=0, ignore_eos=True, presence_penalty=0.4, frequency_penalty=0.6,
                  repetition_penalty=1.3, logit_bias={3: -100.0})
    with LLM(str(path), attention_backend="torch", spec_block_size=4) as llm:
        spec = llm.generate(prompts, SamplingParams(**params))
        plain = llm.generate(prompts, SamplingParams(**params, speculative=False))
        assert llm.acceptance_stats.num_verify_steps > 0
    assert spec == plain
