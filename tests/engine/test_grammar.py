"""Structured outputs in the engine (engine/sampling/grammar.py, engine/sampling/logits_processing.py) with the embedded model and
its tokenizer: a draft block's masks equal the masks of consuming the drafts one at a time (and leave the matcher
where it was); greedy and sampled outputs follow the grammar, the first token included; greedy output is
token-identical with speculation on and off; grammars that do not compile raise GrammarError naming the problem."""
from __future__ import annotations

import dataclasses
import json
import re

import pytest

from engine import LLM, SamplingParams
from engine.sampling.grammar import new_matcher, unpack_bitmasks
from engine.sampling.grammar_compiler import GrammarError, compiler_for
from engine.paths import DEFAULT_MODEL_DIR
from gateway.tokenizer import TextTokenizer

SCHEMA = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "n": {"type": "integer"}},
          "required": ["kind", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def compiler():
    return compiler_for(str(DEFAULT_MODEL_DIR), 4096, (1,))


@pytest.fixture(scope="module")
def tokenizer():
    return TextTokenizer.from_model_dir(DEFAULT_MODEL_DIR)


def test_draft_masks_equal_one_token_at_a_time(compiler, tokenizer):
    """For a draft block that the grammar accepts for a while and then refuses, row j's mask (a bitmask, unpacked)
    equals a fresh
    matcher's mask after drafts[:j] (up to the refused draft); the matcher is left in its state before the block."""
    text_ids = tokenizer.encode('{"kind": "dog", "n": 12}', add_special_tokens=False)
    matcher = new_matcher(compiler, "json_schema", json.dumps(SCHEMA))
    matcher.consume(text_ids[0])
    drafts = text_ids[1:5] + [tokenizer.encode("zzz", add_special_tokens=False)[0]] + text_ids[5:7]
    before = matcher.allowed()
    masks = matcher.draft_masks(drafts)
    assert masks.shape[0] == len(drafts) + 1
    allowed = unpack_bitmasks(masks, 4096)
    assert bool((matcher.allowed() == before).all())
    for j in range(5):
        fresh = new_matcher(compiler, "json_schema", json.dumps(SCHEMA))
        for token in text_ids[: 1 + j]:
            fresh.consume(token)
        assert bool((allowed[j] == fresh.allowed()).all()), j
    assert not bool(allowed[4][drafts[4]])  # the refused draft has no probability under its row


@pytest.mark.parametrize("kind, text", [("json_schema", "{"), ("json_schema", '{"type": "nonsense"}'),
                                        ("regex", "[a-"), ("grammar", "start: undefined_rule"), ("choice", "[]")])
def test_bad_grammars_name_the_problem(compiler, kind, text):
    with pytest.raises(GrammarError, match=kind):
        compiler.check(kind, text)


@pytest.fixture(scope="module")
def llm():
    with LLM(str(DEFAULT_MODEL_DIR), attention_backend="torch", spec_block_size=4) as llm:
        yield llm


def test_outputs_follow_the_grammar_with_and_without_speculation(llm, tokenizer):
    """A regex and a JSON schema: 4 sampled outputs each (temperature 1.2) match / parse and validate, spec on and
    off; greedy outputs are identical with speculation on and off."""
    prompt = tokenizer.encode("def main():\n    x = ")
    regex = "[0-9]{2}-[a-z]{3}"
    for speculative in (None, False):
        for kind, text, check in (("regex", regex, lambda s: re.fullmatch(regex, s)),
                                  ("json_schema", json.dumps(SCHEMA), lambda s: _valid(json.loads(s)))):
            params = [SamplingParams(max_new_tokens=24, temperature=1.2, seed=seed, structured_output=(kind, text),
                                     speculative=speculative) for seed in range(4)]
            for out in llm.generate([prompt] * 4, params):
                assert check(tokenizer.decode(out)), tokenizer.decode(out)
    greedy = SamplingParams(max_new_tokens=24, temperature=0, structured_output=("json_schema", json.dumps(SCHEMA)))
    spec = llm.generate([prompt], greedy)[0]
    plain = llm.generate([prompt], dataclasses.replace(greedy, speculative=False))[0]
    assert spec == plain
    assert llm.acceptance_stats.num_verify_steps > 0


def _valid(value: object) -> bool:
    return (isinstance(value, dict) and set(value) == {"kind", "n"} and value["kind"] in ("cat", "dog")
            and isinstance(value["n"], int))
