"""Sampling controls over the OpenAI HTTP API on the shared deployment (1 prefill + 1 decode with the draft,
so decoding speculates), with the official `openai` client: n choices, logit_bias bans, penalties and
min_tokens / stop_token_ids, each compared with the in-process engine where the output is determined."""
from __future__ import annotations

import asyncio

import aiohttp
import openai
import pytest

from engine import SamplingParams
from tests.services.helpers import scrape
from tests.services.test_openai_http import client, model  # noqa: F401 - the shared openai client fixtures

pytestmark = pytest.mark.slow
PROMPT = [5, 9, 7, 5, 9, 7, 5, 11, 12]


def test_greedy_n3_returns_three_identical_choices(cluster, client, model):
    """n=3 at temperature 0: three choices, indexes 0..2, the same text; usage counts every choice's tokens; the
    choices ran as three requests (x-request-id, .1, .2) on the prefill and decode workers."""
    response = client.completions.create(model=model, prompt=PROMPT, n=3, max_tokens=8, temperature=0,
                                         extra_body={"ignore_eos": True}, extra_headers={"x-request-id": "greedy-n3"})
    assert sorted(choice.index for choice in response.choices) == [0, 1, 2]
    assert len({choice.text for choice in response.choices}) == 1
    assert response.usage.completion_tokens == 24 and response.usage.prompt_tokens == len(PROMPT)
    for name in ("prefill-0", "decode-0"):
        text = (cluster.log_dir / f"{name}.log").read_text()
        assert all(f"request=greedy-n3{suffix} " in text for suffix in ("", ".1", ".2")), name


def test_n3_computes_the_prompt_once(cluster, client, model):
    """n=3 on a 40-token prompt (two full pages of 16): choices 1 and 2 start once choice 0 decodes, so the prefill
    worker's prefix cache serves their first 32 prompt tokens (the gateway's finish lines say so) and the decode
    worker maps its own copy of those pages into their reservations (its cached-token counter grows by 2 x 32:
    the choices decode on shared prompt pages); choice 0 computed it all (negative control: 0 cached)."""
    prompt = [(7 * i + 3) % 50 + 5 for i in range(40)]
    decode_cached = asyncio.run(_decode_cached(cluster))
    response = client.completions.create(model=model, prompt=prompt, n=3, max_tokens=4, temperature=0,
                                         extra_body={"ignore_eos": True}, extra_headers={"x-request-id": "shared-n3"})
    assert len({choice.text for choice in response.choices}) == 1
    lines = [line for line in (cluster.log_dir / "gateway.log").read_text().splitlines() if "finished (" in line]
    for suffix, cached in (("", 0), (".1", 32), (".2", 32)):
        mine = [line for line in lines if f"request=shared-n3{suffix} " in line]
        assert len(mine) == 1 and f"40 prompt ({cached} cached)" in mine[0], (suffix, mine)
    assert asyncio.run(_decode_cached(cluster)) - decode_cached == 64


async def _decode_cached(cluster) -> float:
    """The decode worker's pdserve_decode_cached_tokens_total (prompt tokens its Reserve found cached)."""
    async with aiohttp.ClientSession() as http:
        samples = await scrape(http, cluster.metrics_addresses()["decode-0"])
    return samples[("pdserve_decode_cached_tokens_total", frozenset())]


def test_sampled_n3_streams_three_choices(client, model):
    """n=3 sampled with a seed, streamed: chunks of all three indexes, each choice ends with its own finish
    chunk; the concatenated texts equal the non-streamed response with the same seed (choice i runs seed + i)."""
    kwargs = dict(model=model, prompt=PROMPT, n=3, max_tokens=12, temperature=1.0, seed=11,
                  extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs)
    texts, finishes = {0: "", 1: "", 2: ""}, {}
    for chunk in client.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert finishes == {0: "length", 1: "length", 2: "length"}
    assert texts == {choice.index: choice.text for choice in whole.choices}
    assert len(set(texts.values())) > 1  # different seeds, different samples


def test_logit_bias_ban_and_penalties_match_the_engine(client, model, llm, service_model):
    """Greedy with logit_bias -100 on the tokens the plain greedy output uses: none of them is generated, and the
    text equals the in-process engine's for the same settings; penalties likewise equal the engine's output
    and differ from the plain one."""
    from gateway.tokenizer import TextTokenizer

    tokenizer = TextTokenizer.from_model_dir(service_model)
    plain_ids = llm.generate([PROMPT], SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True))[0]
    banned = sorted(set(plain_ids))[:3]
    bias = {token: -100.0 for token in banned}
    penalties = dict(presence_penalty=1.0, frequency_penalty=1.0, repetition_penalty=1.5)
    for settings in (dict(logit_bias=bias), penalties):
        expected = llm.generate([PROMPT], SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True,
                                                                   **settings))[0]
        body = {"ignore_eos": True, **{k: v for k, v in settings.items() if k not in ("presence_penalty", "frequency_penalty")}}
        if "logit_bias" in body:
            body["logit_bias"] = {str(token): value for token, value in bias.items()}
        response = client.completions.create(
            model=model, prompt=PROMPT, max_tokens=10, temperature=0, extra_body=body,
            **{k: v for k, v in settings.items() if k in ("presence_penalty", "frequency_penalty")})
        prefix = tokenizer.decode(PROMPT)
        assert prefix + response.choices[0].text == tokenizer.decode(PROMPT + expected)
        assert expected != plain_ids
    assert not set(banned) & set(llm.generate(
        [PROMPT], SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True, logit_bias=bias))[0])


def test_min_tokens_and_stop_token_ids(client, model, llm):
    """stop_token_ids with the first greedy token stops after one token; min_tokens 5 holds it back."""
    first = llm.generate([PROMPT], SamplingParams(max_new_tokens=1, temperature=0))[0][0]
    stopped = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0,
                                        extra_body={"stop_token_ids": [first]})
    held = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0,
                                     extra_body={"stop_token_ids": [first], "min_tokens": 5})
    assert stopped.usage.completion_tokens == 1 and stopped.choices[0].finish_reason == "stop"
    assert held.usage.completion_tokens >= 5
