"""`pdserve bench` against a fake gateway with a known token schedule: the whole metric pipeline, end to end."""
from __future__ import annotations

import json
import math

import pytest

from pdserve.cli import main
from tests.bench.fake_gateway import FakeTiming, RunningFake

TIMING = FakeTiming(first_token_s=0.05, chunk_gap_s=0.02, tokens_per_chunk=2)


def _bench(address: str, out, *extra: str) -> int:
    return main(["bench", "--gateway", address, "--num-prompts", "8", "--input-len", "12", "--output-len", "9",
                 "--warmup-requests", "1", "--no-progress", "--output-file", str(out), "--connect-timeout", "5",
                 *extra])


def test_known_schedule_gives_expected_metrics(tmp_path, capsys):
    """8 requests x 9 tokens in chunks of 2, 20 ms apart after a 50 ms first token: token counts exact,
    TTFT >= 50 ms, ITL ~ 10 ms (a 2-token chunk spreads its 20 ms), TPOT ~ 4 gaps / 8 tokens, accept
    length 9/5, per-dollar = output tok/s / (2 x 3.0), ordered percentiles, and the summary on stdout."""
    out = tmp_path / "runs.jsonl"
    with RunningFake(TIMING) as fake:
        code = _bench(fake.address, out, "--max-concurrency", "4", "--gpus", "2", "--gpu-price", "3.0",
                      "--slo", "ttft_ms=10000,tpot_ms=10000", "--seed", "7")
        sent = list(fake.servicer.requests)
    assert code == 0
    lines = out.read_text().splitlines()
    assert len(lines) == 1
    result = json.loads(lines[0])
    assert result["backend"] == "pdserve" and result["model"] == "fake-model"
    assert (result["completed"], result["failed"]) == (8, 0)
    assert result["total_output_tokens"] == 8 * 9 and result["total_input_tokens"] == 8 * 12
    assert result["max_concurrency"] == 4 and result["request_rate"] == "inf"
    assert result["output_throughput"] == pytest.approx(result["total_output_tokens"] / result["duration"])
    assert result["request_throughput"] == pytest.approx(8 / result["duration"])
    assert result["mean_ttft_ms"] >= 50.0
    assert 9.0 <= result["median_itl_ms"] <= 40.0
    assert result["mean_tpot_ms"] >= 4 * 20.0 / 8 * 0.9
    assert result["accept_length"] == pytest.approx(9 / 5)
    assert result["output_throughput_per_dollar"] == pytest.approx(result["output_throughput"] / 6.0)
    assert result["output_throughput_per_gpu"] == pytest.approx(result["output_throughput"] / 2)
    assert result["goodput"] == pytest.approx(result["request_throughput"])
    for name in ("ttft", "tpot", "itl", "e2e_latency"):
        assert result[f"median_{name}_ms"] <= result[f"p90_{name}_ms"] <= result[f"p99_{name}_ms"]
        assert math.isfinite(result[f"mean_{name}_ms"]) and result[f"mean_{name}_ms"] > 0
    assert len(sent) == 9  # 1 warm-up + 8 measured
    assert all(r.ignore_eos and r.max_tokens == 9 and len(r.token_ids.ids) == 12 for r in sent)
    assert all(0 not in r.token_ids.ids for r in sent)  # the eos id is never in a random prompt
    assert all(r.sampling.HasField("temperature") and r.sampling.temperature == 0.0 for r in sent)
    assert not any(r.HasField("speculative") for r in sent)
    stdout = capsys.readouterr().out
    assert "Serving Benchmark Result" in stdout and "Output token throughput (tok/s):" in stdout


def test_sweep_writes_one_line_per_concurrency_and_a_plot(tmp_path):
    """--concurrency-sweep 1,4 runs twice into the same file, and --plot writes a PNG."""
    out, plot = tmp_path / "sweep.jsonl", tmp_path / "sweep.png"
    fast = FakeTiming(first_token_s=0.005, chunk_gap_s=0.002, tokens_per_chunk=1)
    with RunningFake(fast) as fake:
        code = _bench(fake.address, out, "--concurrency-sweep", "1,4", "--plot", str(plot), "--no-speculative")
        sent = list(fake.servicer.requests)
    assert code == 0
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["max_concurrency"] for r in results] == [1, 4]
    assert all(r["completed"] == 8 and r["total_output_tokens"] == 72 for r in results)
    assert results[0]["accept_length"] == pytest.approx(1.0)
    assert all(r.HasField("speculative") and not r.speculative for r in sent)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 10_000


def test_failed_requests_are_counted_not_fatal(tmp_path, caplog):
    """Dataset prompts: a request answered with an in-stream Error counts as failed; the rest complete."""
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text('{"prompt": "a b c", "output_len": 3}\n{"prompt": "fail"}\n')
    out = tmp_path / "runs.jsonl"
    with RunningFake(FakeTiming(first_token_s=0.001, chunk_gap_s=0.001)) as fake:
        code = main(["bench", "--gateway", fake.address, "--dataset", str(dataset), "--num-prompts", "6",
                     "--output-len", "4", "--warmup-requests", "0", "--no-progress", "--output-file", str(out)])
        sent = list(fake.servicer.requests)
    assert code == 0
    result = json.loads(out.read_text())
    assert (result["completed"], result["failed"]) == (3, 3)
    assert result["total_output_tokens"] == 3 * 3 and result["total_input_tokens"] == 3 * 3
    assert result["dataset_name"] == "jsonl" and result["ignore_eos"] is False
    assert not any(r.ignore_eos for r in sent)
    assert any("injected failure" in message for message in caplog.messages)


async def test_client_records_rpc_errors_and_chunk_timing():
    """GatewayClient.send: an RPC that fails with a status becomes a failed record naming the status; a good
    stream gives TTFT >= the first-token delay, one ITL per token after the first chunk, and the accept stat."""
    import grpc

    from bench.client import GatewayClient
    from bench.workload import BenchRequest

    with RunningFake(TIMING) as fake:
        async with grpc.aio.insecure_channel(fake.address) as channel:
            client = GatewayClient(channel)
            info = await client.model_info(fake.address, timeout_s=5)
            bad = await client.send(BenchRequest(output_len=4, ignore_eos=True, token_ids=(info.vocab_size,)))
            good = await client.send(BenchRequest(output_len=5, ignore_eos=True, token_ids=(5, 6, 7)))
    assert info.vocab_size == TIMING.vocab_size and info.eos_token_ids == {TIMING.eos_token_id}
    assert not bad.success and bad.error.startswith("INVALID_ARGUMENT")
    assert good.success and good.finish_reason == "LENGTH" and good.output_tokens == 5
    assert good.ttft_s >= TIMING.first_token_s
    assert len(good.itl_s) == 5 - TIMING.tokens_per_chunk
    # the fake sleeps chunk_gap before each later chunk, so the last chunk arrives no sooner than this after the
    # request (chunks may arrive bunched on a loaded machine: the sum of the ITLs alone has no lower bound)
    assert good.ttft_s + sum(good.itl_s) >= (TIMING.first_token_s + 2 * TIMING.chunk_gap_s) * 0.9
    assert good.e2e_s >= good.ttft_s + sum(good.itl_s) - 1e-9
    assert good.accept_length == pytest.approx(5 / 3)
    assert good.prompt_tokens == 3
