"""`pdserve bench` against a live deployment (gateway + prefill + decode processes, as `pdserve up` starts
them): the JSON line's fields are consistent with the workload and with each other."""
from __future__ import annotations

import json
import math

import pytest

from pdserve.cli import main
from pdserve.launcher import Cluster, ClusterSpec
from tests.services.service_model import make_service_model

pytestmark = pytest.mark.slow

REQUESTS, INPUT_LEN, OUTPUT_LEN, CONCURRENCY = 8, 32, 16, 4


@pytest.fixture(scope="module")
def live_gateway(tmp_path_factory):
    """The services' test deployment: a tiny random model with a draft (speculative decoding on), 1 prefill +
    1 decode worker + gateway, each its own process, on loopback port 0."""
    root = tmp_path_factory.mktemp("bench-live")
    spec = ClusterSpec(model_dir=str(make_service_model(root)), listen="127.0.0.1:0", attention_backend="torch",
                       worker_args=("--kv-memory-mb", "64", "--num-threads", "1"))
    cluster = Cluster(spec, log_dir=root)
    try:
        yield cluster.start(timeout_s=300)
    except (RuntimeError, TimeoutError) as error:
        logs = "\n".join(f"--- {log.name}\n{log.read_text()[-3000:]}" for log in sorted(root.glob("*.log")))
        pytest.fail(f"deployment did not start: {error}\n{logs}")
    finally:
        cluster.stop()


def test_bench_jsonl_is_consistent_with_the_workload(live_gateway, tmp_path):
    """8 random prompts of 32 tokens asking for 16 (ignore_eos) at concurrency 4: all complete, token totals
    are exact, TPOT and ITL are finite and positive, percentiles are ordered, throughputs = amount / duration."""
    out = tmp_path / "live.jsonl"
    code = main(["bench", "--gateway", live_gateway, "--num-prompts", str(REQUESTS), "--input-len", str(INPUT_LEN),
                 "--output-len", str(OUTPUT_LEN), "--max-concurrency", str(CONCURRENCY), "--warmup-requests", "1",
                 "--no-progress", "--output-file", str(out), "--gpus", "1", "--gpu-price", "2.5",
                 "--slo", "ttft_ms=600000", "--request-timeout", "300"])
    assert code == 0
    lines = out.read_text().splitlines()
    assert len(lines) == 1
    result = json.loads(lines[0])
    assert (result["completed"], result["failed"]) == (REQUESTS, 0)
    assert result["max_concurrency"] == CONCURRENCY and result["ignore_eos"] is True
    assert result["total_output_tokens"] == REQUESTS * OUTPUT_LEN
    assert result["total_input_tokens"] == REQUESTS * INPUT_LEN
    duration = result["duration"]
    assert duration > 0
    assert result["output_throughput"] == pytest.approx(REQUESTS * OUTPUT_LEN / duration)
    assert result["input_throughput"] == pytest.approx(REQUESTS * INPUT_LEN / duration)
    assert result["total_token_throughput"] == pytest.approx(REQUESTS * (INPUT_LEN + OUTPUT_LEN) / duration)
    assert result["request_throughput"] == pytest.approx(REQUESTS / duration)
    assert result["output_throughput_per_dollar"] == pytest.approx(result["output_throughput"] / 2.5)
    assert result["goodput"] == pytest.approx(result["request_throughput"])
    for name in ("ttft", "tpot", "itl", "e2e_latency"):
        values = [result[f"{stat}_{name}_ms"] for stat in ("mean", "median", "p90", "p99")]
        assert all(math.isfinite(v) and v > 0 for v in values), (name, values)
        assert result[f"median_{name}_ms"] <= result[f"p90_{name}_ms"] <= result[f"p99_{name}_ms"]
    assert result["mean_e2e_latency_ms"] > result["mean_ttft_ms"]
    assert result["p99_e2e_latency_ms"] <= duration * 1000
    assert result["accept_length"] >= 1.0  # the model has a draft: every request reports its acceptance


def test_no_speculative_run_reports_unit_acceptance(live_gateway, tmp_path):
    """A run with --no-speculative is accepted by the live server, completes, and reports one token per decode
    step (acceptance exactly 1). (That the flag is on the wire is checked against the fake gateway.)"""
    out = tmp_path / "nospec.jsonl"
    code = main(["bench", "--gateway", live_gateway, "--num-prompts", "4", "--input-len", "16", "--output-len", "8",
                 "--max-concurrency", "2", "--warmup-requests", "0", "--no-progress", "--no-speculative",
                 "--output-file", str(out), "--request-timeout", "300"])
    assert code == 0
    result = json.loads(out.read_text())
    assert (result["completed"], result["total_output_tokens"]) == (4, 32)
    assert result["speculative"] is False and result["accept_length"] == pytest.approx(1.0)


def test_prefix_workloads_against_the_live_cache(live_gateway, tmp_path):
    """The prefix workloads against the live deployment (its prefill worker's prefix cache on): shared-prefix
    requests after the first of their prefix are served their prefix's whole pages (hit rate >= 80% of the
    achievable: 96-128-token prefixes in 16-token pages), and the later turns of a chat take cached tokens (the
    previous prompt's pages: the prefill worker never saw the answers), never more than achievable."""
    out = tmp_path / "prefix.jsonl"
    common = ["bench", "--gateway", live_gateway, "--no-progress", "--output-file", str(out), "--request-timeout",
              "300", "--output-len", "8", "--warmup-requests", "0", "--max-concurrency", "1"]
    assert main([*common, "--workload", "shared-prefix", "--num-prompts", "6", "--num-prefixes", "2",
                 "--prefix-min-len", "96", "--prefix-len", "128", "--suffix-len", "8"]) == 0
    assert main([*common, "--workload", "multi-turn", "--conversations", "2", "--turns", "3", "--input-len", "40",
                 "--think-time", "0"]) == 0
    shared, chat = (json.loads(line) for line in out.read_text().splitlines())
    assert shared["completed"] == 6 and shared["total_achievable_cached_tokens"] >= 4 * 96
    assert 0.8 <= shared["cache_hit_rate"] <= 1.0
    assert chat["completed"] == 6 and chat["total_cached_tokens"] > 0
    assert 0.0 < chat["cache_hit_rate"] <= 1.0 and chat["median_ttft_later_turns_ms"] > 0
