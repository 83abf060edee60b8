"""Workloads: random prompt lengths and range ratio, vocabulary limits, seed determinism, JSONL prompts."""
from __future__ import annotations

import json

import pytest

from bench.workload import BenchRequest, WorkloadError, dataset_requests, random_requests


def test_fixed_lengths_by_default():
    """range ratio 1.0: every prompt has exactly input_len tokens and asks for output_len."""
    requests = random_requests(20, input_len=32, output_len=16, vocab_size=100, seed=3)
    assert len(requests) == 20
    assert {r.prompt_tokens for r in requests} == {32}
    assert {r.output_len for r in requests} == {16}
    assert all(r.ignore_eos for r in requests)


def test_range_ratio_bounds_and_spread():
    """Lengths fall in [len * ratio, len] and actually vary."""
    requests = random_requests(400, input_len=100, output_len=40, vocab_size=50, range_ratio=0.5, seed=1)
    inputs = [r.prompt_tokens for r in requests]
    outputs = [r.output_len for r in requests]
    assert min(inputs) >= 50 and max(inputs) <= 100
    assert min(outputs) >= 20 and max(outputs) <= 40
    assert len(set(inputs)) > 20 and max(inputs) == 100 and min(inputs) == 50
    zero = random_requests(200, input_len=10, output_len=10, vocab_size=50, range_ratio=0.0, seed=1)
    assert min(r.prompt_tokens for r in zero) >= 1


def test_token_ids_in_vocab_and_not_special():
    """Ids are drawn from [0, vocab) minus the special ids."""
    special = frozenset({0, 1, 2, 7})
    requests = random_requests(50, input_len=64, output_len=4, vocab_size=12, special_ids=special, seed=5)
    used = {token for r in requests for token in r.token_ids}
    assert used <= set(range(12)) - special
    assert len(used) == 8  # every allowed id shows up in 3200 draws


def test_same_seed_same_prompts_other_seed_differs():
    """The seed fixes the workload exactly."""
    first = random_requests(10, 16, 8, vocab_size=1000, range_ratio=0.3, seed=42)
    again = random_requests(10, 16, 8, vocab_size=1000, range_ratio=0.3, seed=42)
    other = random_requests(10, 16, 8, vocab_size=1000, range_ratio=0.3, seed=43)
    assert first == again
    assert first != other


def test_bad_workloads_raise():
    """Impossible settings are refused with a WorkloadError."""
    with pytest.raises(WorkloadError):
        random_requests(1, 8, 8, vocab_size=3, special_ids=frozenset({0, 1, 2}))
    with pytest.raises(WorkloadError):
        random_requests(1, 8, 8, vocab_size=10, range_ratio=1.5)
    with pytest.raises(WorkloadError):
        BenchRequest(output_len=4, ignore_eos=False)


def test_dataset_file_cycles_and_defaults(tmp_path):
    """JSONL prompts in file order, repeated to the count; output_len defaults when missing."""
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "hello", "output_len": 5}) + "\n\n" + json.dumps({"prompt": "héllo"}) + "\n")
    requests = dataset_requests(path, count=5, default_output_len=9, ignore_eos=False)
    assert [r.text for r in requests] == ["hello", "héllo", "hello", "héllo", "hello"]
    assert [r.output_len for r in requests] == [5, 9, 5, 9, 5]
    assert requests[0].prompt_tokens == 0  # counted by the server


@pytest.mark.parametrize("line, fragment", [
    ("{not json", ":1: not valid JSON"),
    ('{"text": "x"}', 'non-empty string "prompt"'),
    ('{"prompt": "x", "output_len": 0}', '"output_len" must be a positive integer'),
])
def test_dataset_errors_name_the_line(tmp_path, line, fragment):
    """A bad line fails with the file and line number in a one-line message."""
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(WorkloadError, match=".*") as caught:
        dataset_requests(path, 1, 4, False)
    assert fragment in str(caught.value) and "\n" not in str(caught.value)
