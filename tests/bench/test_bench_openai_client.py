"""The OpenAI backend's pure parts: request bodies carry the workload and the sampling options, and
completion tokens are spread evenly over the chunks for ITL."""
from __future__ import annotations

import pytest

from bench.config import BenchConfig, SamplingOptions
from bench.openai_client import completion_body, even_counts
from bench.workload import BenchRequest


def test_body_streams_with_usage_and_the_workload():
    """Token-id prompts go as token ids, with max_tokens, ignore_eos, streaming usage and set options only."""
    body = completion_body("tiny", BenchRequest(8, True, token_ids=(5, 6)), SamplingOptions(temperature=0.0, top_k=4))
    assert body["prompt"] == [5, 6] and body["max_tokens"] == 8 and body["ignore_eos"] is True
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert (body["temperature"], body["top_k"]) == (0.0, 4) and "top_p" not in body
    assert completion_body("tiny", BenchRequest(3, False, text="hi"), SamplingOptions())["prompt"] == "hi"


@pytest.mark.parametrize("total,chunks", [(8, 8), (10, 4), (3, 5), (0, 2), (7, 0)])
def test_even_counts_sum_to_the_total(total, chunks):
    """Counts add up to the total (when there are chunks) and differ by at most one."""
    counts = even_counts(total, chunks)
    assert len(counts) == chunks
    if chunks:
        assert sum(counts) == total and max(counts) - min(counts) <= 1


def test_backend_and_base_url_are_checked():
    """An unknown backend or a base URL that is not http(s) is refused, naming the flag."""
    with pytest.raises(ValueError, match="--backend"):
        BenchConfig(gateway="x:1", backend="vllm")
    with pytest.raises(ValueError, match="--base-url"):
        BenchConfig(gateway="x:1", base_url="127.0.0.1:8000")
