"""Request validation: every bad GenerateRequest raises InvalidArgument naming the field; defaults resolve."""
from __future__ import annotations

import pytest

from gateway.model_info import ModelFacts, SamplingDefaults
from gateway.requests import check_input, parse_generate_request
from gateway.tokenizer import TextTokenizer
from gateway.wire import parse_generate_request_bytes, top_level_fields
from rpc.status import InvalidArgument
from rpc.v1 import gateway_pb2 as pb
from tests.gateway.text_tokenizer import make_tokenizer

FACTS = ModelFacts(name="m", vocab_size=320, max_context=64, eos_token_ids=(1,),
                   defaults=SamplingDefaults(temperature=0.7, top_p=0.9))


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> TextTokenizer:
    return TextTokenizer.from_file(make_tokenizer(tmp_path_factory.mktemp("tok")))


def parse(request, tokenizer=None, both=False):
    return parse_generate_request(request, FACTS, tokenizer, default_max_tokens=16, both_inputs=both)


def ids(*values):
    return pb.TokenIds(ids=list(values))


BAD = [
    (pb.GenerateRequest(), "input"),
    (pb.GenerateRequest(text=""), "input.text"),
    (pb.GenerateRequest(token_ids=ids()), "input.token_ids"),
    (pb.GenerateRequest(token_ids=ids(3, 320)), "input.token_ids[1]"),
    (pb.GenerateRequest(token_ids=ids(-1)), "input.token_ids[0]"),
    (pb.GenerateRequest(token_ids=ids(3, 5, 900, -1)), "input.token_ids[2]"),  # the first bad one is named
    (pb.GenerateRequest(token_ids=ids(*[5] * 64)), "input"),
    (pb.GenerateRequest(token_ids=ids(*[5] * 60), max_tokens=5), "max_tokens"),
    (pb.GenerateRequest(token_ids=ids(5), max_tokens=0), "max_tokens"),
    (pb.GenerateRequest(token_ids=ids(5), max_tokens=-3), "max_tokens"),
    (pb.GenerateRequest(token_ids=ids(5), sampling=pb.SamplingParams(temperature=-1)), "sampling.temperature"),
    (pb.GenerateRequest(token_ids=ids(5), sampling=pb.SamplingParams(top_p=0)), "sampling.top_p"),
    (pb.GenerateRequest(token_ids=ids(5), sampling=pb.SamplingParams(top_k=-5)), "sampling.top_k"),
    (pb.GenerateRequest(token_ids=ids(5), sampling=pb.SamplingParams(min_p=1.5)), "sampling.min_p"),
    (pb.GenerateRequest(token_ids=ids(5), top_logprobs=21), "top_logprobs"),
    (pb.GenerateRequest(token_ids=ids(5), block_size=1), "block_size"),
    (pb.GenerateRequest(token_ids=ids(5), stop_token_ids=[400]), "stop_token_ids[0]"),
    (pb.GenerateRequest(token_ids=ids(5), stop=["x", ""]), "stop[1]"),
    (pb.GenerateRequest(token_ids=ids(5), request_id="r" * 300), "request_id"),
    (pb.GenerateRequest(token_ids=ids(5), stream_interval=0), "stream_interval"),
    (pb.GenerateRequest(token_ids=ids(5), stream_interval=1025), "stream_interval"),
]


@pytest.mark.parametrize("request_message,field", BAD, ids=[f for _, f in BAD])
def test_bad_requests_name_their_field(request_message, field, tokenizer):
    """Each malformed request fails with InvalidArgument whose field (and message prefix) is the culprit."""
    with pytest.raises(InvalidArgument) as caught:
        parse(request_message, tokenizer)
    assert caught.value.field == field
    assert str(caught.value).startswith(field + ":")


def test_check_input_returns_the_checked_ids_or_the_text(tokenizer):
    """check_input hands back the prompt's token ids (checked once, then passed on to parse_generate_request)
    or the text to tokenise; the job built from them is the one parse_generate_request builds alone."""
    by_ids = pb.GenerateRequest(request_id="r1", token_ids=ids(3, 4, 5), max_tokens=2)
    checked = check_input(by_ids, FACTS, tokenizer)
    assert checked == [3, 4, 5]
    assert parse_generate_request(by_ids, FACTS, tokenizer, 16, prompt_ids=checked) == parse(by_ids, tokenizer)
    assert check_input(pb.GenerateRequest(text="hello"), FACTS, tokenizer) == "hello"


def test_text_without_tokenizer_is_rejected():
    """A text prompt to a model without tokenizer.json names input.text."""
    with pytest.raises(InvalidArgument, match=r"^input\.text:"):
        parse(pb.GenerateRequest(text="hi"))


def test_both_inputs_on_the_wire_are_rejected(tokenizer):
    """A message that sets text and token_ids (protobuf would keep the last) is detected from its bytes."""
    data = pb.GenerateRequest(text="hello").SerializeToString() + pb.GenerateRequest(token_ids=ids(5)).SerializeToString()
    wire = parse_generate_request_bytes(data)
    assert wire.message.WhichOneof("input") == "token_ids" and wire.both_inputs
    with pytest.raises(InvalidArgument, match=r"^input:.*both"):
        parse(wire.message, tokenizer, both=wire.both_inputs)
    assert not parse_generate_request_bytes(pb.GenerateRequest(text="a", max_tokens=3).SerializeToString()).both_inputs


def test_top_level_fields_skips_nested_and_all_wire_types():
    """The wire scan reports exactly the top-level field numbers, whatever their wire type."""
    message = pb.GenerateRequest(request_id="x", token_ids=ids(1, 2, 300), sampling=pb.SamplingParams(temperature=0.5, seed=7),
                                 max_tokens=4, ignore_eos=True)
    assert top_level_fields(message.SerializeToString()) == {1, 3, 4, 5, 8}


def test_unset_fields_take_generation_config_then_engine_defaults(tokenizer):
    """Unset temperature/top_p come from generation_config; an explicit temperature 0 is kept (greedy)."""
    job = parse(pb.GenerateRequest(text="import os", request_id="abc"), tokenizer)
    assert job.request_id == "abc" and job.prompt_ids == tuple(tokenizer.encode("import os"))
    assert job.params.temperature == pytest.approx(0.7) and job.params.top_p == pytest.approx(0.9)
    assert job.params.top_k == -1 and job.params.max_new_tokens == 16
    greedy = parse(pb.GenerateRequest(token_ids=ids(5, 6), sampling=pb.SamplingParams(temperature=0.0)))
    assert greedy.params.temperature == 0.0 and greedy.params.greedy
    assert len(greedy.request_id) == 32  # a uuid was assigned


def test_default_max_tokens_fits_the_context():
    """Without max_tokens, generation is capped by the room left in the context."""
    job = parse(pb.GenerateRequest(token_ids=ids(*[5] * 60)))
    assert job.params.max_new_tokens == 4


def test_options_carry_over():
    """stop ids, ignore_eos, logprobs, speculative and block size reach the SamplingParams."""
    job = parse(pb.GenerateRequest(token_ids=ids(5), stop_token_ids=[7], ignore_eos=True, top_logprobs=3,
                                   speculative=False, block_size=4, sampling=pb.SamplingParams(seed=9)))
    p = job.params
    assert (p.stop_token_ids, p.ignore_eos, p.logprobs, p.speculative, p.block_size, p.seed) == ((7,), True, 3, False, 4, 9)
    assert job.ends_on(7) and not job.ends_on(1)
    assert parse(pb.GenerateRequest(token_ids=ids(5))).ends_on(1)


def test_stream_interval_defaults_to_every_step_and_carries_over():
    """Unset stream_interval means a chunk per decode step (1); a set value reaches the job unchanged."""
    assert parse(pb.GenerateRequest(token_ids=ids(5))).stream_interval == 1
    assert parse(pb.GenerateRequest(token_ids=ids(5), stream_interval=8)).stream_interval == 8
