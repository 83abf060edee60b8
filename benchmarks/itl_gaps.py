"""Where a serving deployment's slow inter-token gaps fall inside a request: a closed loop at --concurrency of
random --input-len-token prompts (--output-len tokens, greedy, ignore_eos) against an OpenAI-compatible server
(`pdserve up` or vLLM), after one unrecorded warm-up pass on prompts of its own; prints the ITL p50 / p90 / p99 /
max and, for the slowest --top fraction of gaps, the token positions they follow (0: the gap after the first token).

Run: .venv/bin/python -m benchmarks.itl_gaps --base-url http://127.0.0.1:8000/v1 [--concurrency 16] [--vocab N]
"""
from __future__ import annotations

import argparse
import asyncio
import os
from collections import Counter

import aiohttp

from bench.config import SamplingOptions
from bench.load import LoadPlan, run_load
from bench.openai_client import OpenAIClient
from bench.workload import random_requests
from benchmarks.common import cpu_flags
from benchmarks.peer_vllm import PEER_SHAPE, SPECIAL_IDS, model_id


async def gaps(args: argparse.Namespace) -> list[tuple[float, int]]:
    requests = random_requests(args.num_prompts, args.input_len, args.output_len, args.vocab, SPECIAL_IDS, seed=16)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        client = OpenAIClient(session, args.base_url, SamplingOptions(temperature=0.0, timeout_s=600.0))
        client.model = model_id(args.base_url)
        # The warm-up runs prompts of its own: measured prompts seen before would hit the prefix cache and run as
        # short continuation chunks (slow steps that a fresh workload never has).
        warmup = random_requests(args.concurrency, args.input_len, args.output_len, args.vocab, SPECIAL_IDS, seed=17)
        await run_load(warmup, client.send, LoadPlan(max_concurrency=args.concurrency))
        outcome = await run_load(requests, client.send, LoadPlan(max_concurrency=args.concurrency))
    failed = [record.error for record in outcome.records if not record.success]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(requests)} requests failed, first: {failed[0]}")
    return sorted((gap, position) for record in outcome.records for position, gap in enumerate(record.itl_s))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--num-prompts", type=int, default=48)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=PEER_SHAPE["vocab_size"],
                        help="the model's vocabulary size (random prompt ids; default: peer_vllm's checkpoint)")
    parser.add_argument("--top", type=float, default=0.02)
    args = parser.parse_args()
    print(f"CPU flags: {cpu_flags()}; load average {os.getloadavg()[0]:.1f}")
    found = asyncio.run(gaps(args))
    values = [gap * 1000 for gap, _ in found]
    at = lambda q: values[min(len(values) - 1, int(q * len(values)))]  # noqa: E731
    print(f"{len(values)} gaps: p50 {at(0.5):.1f} ms, p90 {at(0.9):.1f} ms, p99 {at(0.99):.1f} ms, max {values[-1]:.1f} ms")
    top = found[-max(1, int(args.top * len(found))):]
    print(f"the slowest {args.top:.0%}: after token positions {sorted(Counter(position for _, position in top).items())}")
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
