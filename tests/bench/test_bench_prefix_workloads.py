"""`pdserve bench --workload shared-prefix | multi-turn` (bench/prefix_workloads.py, bench/conversations.py): the
workloads' shapes, and the cache accounting against a fake gateway whose stand-in prefix cache reports a known
number of cached tokens (tests/bench/fake_gateway.py), with it on and off.

Invariants: shared-prefix request i carries prefix i % K and a suffix of the asked length, and could take its
prefix from the cache unless it is the first of its prefix; turn t of a conversation sends exactly the history
(every earlier message and the answers the server streamed) plus a new message, and could take the whole history
from the cache; the reported cached tokens are the server's, the hit rate is their sum over the achievable sum
(0 with no cache), and TTFT of turns >= 2 is reported beside all requests'."""
from __future__ import annotations

import asyncio
import io
import json

import numpy as np
import pytest

from bench.config import BenchConfig, SamplingOptions
from bench.prefix_workloads import ConversationScript, ConversationShape, SharedPrefixShape, shared_prefix_requests
from bench.runner import run_benchmark
from pdserve.cli import main
from tests.bench.fake_gateway import FakeTiming, RunningFake, fake_answer_token

PAGE = 16
VOCAB = 5000
ALLOWED = np.arange(1, VOCAB)


def test_shared_prefix_shape():
    """10 requests over 3 prefixes of 40..90 tokens, suffixes of 4..8: request i starts with prefix i % 3, all
    prompts of one prefix share exactly it, and the achievable count is the prefix for all but the first three."""
    shape = SharedPrefixShape(num_prefixes=3, prefix_min_len=40, prefix_len=90, suffix_len=8)
    requests = shared_prefix_requests(10, shape, 5, ALLOWED, range_ratio=0.5, seed=3)
    assert len(requests) == 10
    prefix_lens = [requests[k].achievable_cached for k in range(3, 6)]
    assert all(40 <= length <= 90 for length in prefix_lens)
    for index, request in enumerate(requests):
        length = prefix_lens[index % 3]
        assert request.token_ids[:length] == requests[3 + index % 3].token_ids[:length]
        assert 4 <= len(request.token_ids) - length <= 8 and request.turn == 0
        assert request.achievable_cached == (length if index >= 3 else 0)
    assert shared_prefix_requests(10, shape, 5, ALLOWED, range_ratio=0.5, seed=3) == requests  # seeded
    with pytest.raises(ValueError, match="--prefix-min-len"):
        SharedPrefixShape(prefix_min_len=100, prefix_len=50)


def test_conversation_script_turns():
    """Turn t = the history given + this turn's message; achievable = the history; messages within the lengths."""
    script = ConversationScript(ConversationShape(conversations=2, turns=3, think_time_s=0), 20, 6, ALLOWED,
                                range_ratio=0.5, seed=1)
    history = (7, 8, 9)
    turn = script.turn(1, 2, history, ignore_eos=True)
    assert turn.token_ids[:3] == history and turn.token_ids[3:] == script.messages[1 * 3 + 1]
    assert turn.achievable_cached == 3 and turn.turn == 2 and 10 <= len(turn.token_ids) - 3 <= 20
    assert script.turn(0, 1, (), ignore_eos=True).achievable_cached == 0
    with_system = ConversationScript(ConversationShape(conversations=2, turns=3, think_time_s=0, system_len=30), 20, 6,
                                     ALLOWED, range_ratio=0.5, seed=1)
    first = with_system.turn(1, 1, (), ignore_eos=True)
    assert first.token_ids == with_system.systems[1] + with_system.messages[3] and first.achievable_cached == 0
    assert len(with_system.systems[1]) == 30 and with_system.systems[0] != with_system.systems[1]
    with pytest.raises(ValueError, match="--turns"):
        ConversationShape(turns=0)


def _run(fake: RunningFake, workload: str, **fields: object) -> dict:
    config = BenchConfig(gateway=fake.address, workload=workload, warmup_requests=1, progress=False,
                         connect_timeout_s=5.0, **fields)
    [result] = asyncio.run(run_benchmark(config, SamplingOptions(), stdout=io.StringIO()))
    return result


@pytest.mark.parametrize("cache", [True, False], ids=["cache", "no-cache"])
def test_multi_turn_resends_the_real_history_and_counts_hits(cache):
    """3 conversations x 3 turns, 2 in flight at most: every turn >= 2 sends the previous turn's prompt plus the
    fake's actual answer to it plus a new message; cached tokens = the fake's page-rounded history (0 without a
    cache), the hit rate = cached / history tokens, TTFT of turns >= 2 reported."""
    timing = FakeTiming(first_token_s=0.001, chunk_gap_s=0.001, vocab_size=VOCAB, cache_page_size=PAGE if cache else 0)
    with RunningFake(timing) as fake:
        result = _run(fake, "multi-turn", input_len=24, output_len=5, range_ratio=0.5, concurrencies=(2,),
                      conversation=ConversationShape(conversations=3, turns=3, think_time_s=0.0))
        sent = [list(request.token_ids.ids) for request in fake.servicer.requests[1:]]  # after the warm-up
    assert (result["completed"], result["failed"]) == (9, 0) and len(sent) == 9
    by_start = {tuple(prompt[:3]): [] for prompt in sent}
    for prompt in sent:
        by_start[tuple(prompt[:3])].append(prompt)
    assert len(by_start) == 3 and all(len(turns) == 3 for turns in by_start.values())
    shape = ConversationShape(conversations=3, turns=3, think_time_s=0.0)
    script = ConversationScript(shape, 24, 5, np.arange(1, VOCAB), range_ratio=0.5, seed=0)  # the run's own
    achievable = expected_cached = 0
    for conversation in range(3):
        turns = sorted(by_start[script.messages[conversation * 3][:3]], key=len)
        for turn, (previous, prompt) in enumerate(zip(turns, turns[1:])):
            answer = [fake_answer_token(len(previous), index, VOCAB)
                      for index in range(script.output_lens[conversation * 3 + turn])]
            history = previous + answer
            assert prompt[: len(history)] == history and 12 <= len(prompt) - len(history) <= 24
            achievable += len(history)
            expected_cached += len(history) // PAGE * PAGE
    assert result["total_achievable_cached_tokens"] == achievable
    assert result["total_cached_tokens"] == (expected_cached if cache else 0)
    assert result["cache_hit_rate"] == pytest.approx(expected_cached / achievable if cache else 0.0)
    assert result["median_ttft_later_turns_ms"] is not None and result["p90_ttft_later_turns_ms"] is not None
    assert result["workload"] == "multi-turn" and result["turns"] == 3


@pytest.mark.parametrize("cache", [True, False], ids=["cache", "no-cache"])
def test_shared_prefix_hit_rate_is_cached_over_shared(cache):
    """8 requests over 2 prefixes, one at a time: the first of each prefix misses, every later one is served
    its prefix's whole pages (the fake's cache) - hit rate = page-rounded prefixes / prefixes; 0 without a cache."""
    timing = FakeTiming(first_token_s=0.001, chunk_gap_s=0.001, vocab_size=VOCAB, cache_page_size=PAGE if cache else 0)
    shape = SharedPrefixShape(num_prefixes=2, prefix_min_len=50, prefix_len=120, suffix_len=6)
    with RunningFake(timing) as fake:
        result = _run(fake, "shared-prefix", num_prompts=8, output_len=3, concurrencies=(1,), shared_prefix=shape)
    requests = shared_prefix_requests(8, shape, 3, np.arange(1, VOCAB), seed=0)
    achievable = sum(request.achievable_cached for request in requests)
    cached = sum(request.achievable_cached // PAGE * PAGE for request in requests)
    assert result["total_achievable_cached_tokens"] == achievable > 0
    assert result["total_cached_tokens"] == (cached if cache else 0)
    assert result["cache_hit_rate"] == pytest.approx(cached / achievable if cache else 0.0)
    assert result["mean_cached_tokens"] == pytest.approx(result["total_cached_tokens"] / 8)


def test_summary_prints_the_cache_rows(tmp_path, capsys):
    """The summary of a prefix workload shows cached and achievable tokens, the hit rate, and TTFT p50 / p90 of
    turns >= 2 beside all requests'; the JSON line carries them."""
    timing = FakeTiming(first_token_s=0.001, chunk_gap_s=0.001, vocab_size=VOCAB, cache_page_size=PAGE)
    out = tmp_path / "runs.jsonl"
    with RunningFake(timing) as fake:
        code = main(["bench", "--gateway", fake.address, "--workload", "multi-turn", "--conversations", "2",
                     "--turns", "2", "--think-time", "0", "--input-len", "20", "--output-len", "4", "--no-progress",
                     "--output-file", str(out), "--connect-timeout", "5"])
    assert code == 0
    text = capsys.readouterr().out
    assert "Prefix Cache" in text and "Hit rate (cached / achievable, %)" in text
    assert "P50 TTFT turns >= 2 / all (ms)" in text and "P90 TTFT turns >= 2 / all (ms)" in text
    result = json.loads(out.read_text())
    assert result["completed"] == 4 and result["cache_hit_rate"] is not None


@pytest.mark.parametrize("extra, message", [
    (["--workload", "multi-turn", "--backend", "openai"], "multi-turn needs --backend pdserve"),
    (["--workload", "shared-prefix", "--prefix-min-len", "0"], "--prefix-min-len"),
    (["--workload", "multi-turn", "--think-time", "-1"], "--think-time"),
    (["--workload", "multi-turn", "--conversations", "0"], "--conversations"),
    (["--workload", "multi-turn", "--system-prompt-len", "-5"], "--system-prompt-len"),
])
def test_bad_workload_options_are_one_line_errors(extra, message, capsys):
    """Bad prefix-workload options exit 2 with one line naming the option, before connecting anywhere."""
    assert main(["bench", "--gateway", "127.0.0.1:1", *extra]) == 2
    error = capsys.readouterr().err
    assert message in error and error.count("\n") == 1
