"""Conditional disaggregation (issue 34 item 4): a chat turn prefilled on its decode worker (no prefill hop) against
the same turn prefilled by a prefill worker, by the length of its new part; and what local prefills cost the
requests decoding beside them.

Deployment (pdserve.launcher, real processes): 1 prefill + 1 decode worker (TP 1, shm, speculation on) and two
gateways on the same workers: "disagg" (--disagg-threshold-tokens 0: always a prefill worker) and "local" (10**6:
always the decode worker when its cache holds the history). Standing leases off (a spare takes no prefix lookup).

1. TTFT by suffix length: a 1,020-token history is answered once (16 tokens: the decode worker then holds the
   history's pages and, K3, a state checkpoint at 1,024); each turn = history + answer + N fresh random tokens.
   "disagg": Reserve (the decode worker's hit: no page of the history is sent) + Prefill (the prefill worker's own
   cache holds the history but not the answer) + handoff; "local": the decode worker prefills the N + 12 new
   tokens itself. Interleaved, --repeats each; TTFT = submission to the first token at the client.
2. Inter-token latency of running decodes while local prefills arrive: --streams requests decode (long outputs)
   while turns with a --itl-suffix-token new part arrive back to back on the "local" gateway; the gaps between the
   streams' token chunks, against the same streams with no prefill arriving. Run once with the decode worker's
   bounded prefill steps (--local-prefill-tokens-per-step, default 128) and once unbounded (0).

    .venv/bin/python -m benchmarks.bench_local_prefill --model models/pdserve-k3-tiny --repeats 5
"""
from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from pathlib import Path

import grpc

from benchmarks.common import add_common_arguments, print_header, spread
from gateway.client import build_request
from pdserve.launcher import Cluster, ClusterSpec
from rpc.v1 import gateway_pb2_grpc

HISTORY, ANSWER = 1020, 16
VOCAB_LOW, VOCAB_HIGH = 4, 300


def _tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(count)]


def _start(model: str, prefill_tokens_per_step: int, log_dir: Path) -> tuple[Cluster, str, str]:
    """The deployment and its two gateways' addresses (disagg, local)."""
    spec = ClusterSpec(model_dir=model, listen="127.0.0.1:0", attention_backend="torch",
                       worker_args=("--num-threads", "1"),
                       decode_args=("--local-prefill-tokens-per-step", str(prefill_tokens_per_step)),
                       gateway_args=("--standing-lease-tokens", "0", "--disagg-threshold-tokens", "0"))
    cluster = Cluster(spec, log_dir=log_dir)
    cluster.start(timeout_s=600)
    try:
        gateway = next(child for child in cluster.children if child.role == "gateway")
        args = gateway.command[gateway.command.index("gateway") + 1 : gateway.command.index("--ready-file")]
        args += ["--listen", "127.0.0.1:0", "--http-listen", "", "--disagg-threshold-tokens", str(10**6)]
        local = cluster._spawn("gateway", "gateway-local", args)  # noqa: SLF001 - a second gateway, same workers
        cluster._wait_ready([local], time.monotonic() + 120)  # noqa: SLF001
    except BaseException:
        cluster.stop()
        raise
    return cluster, cluster.gateway_address, local.address


async def _first_token_s(stub: gateway_pb2_grpc.GatewayServiceStub, prompt: list[int], max_tokens: int) -> float:
    """Seconds from submission to the first token chunk (the stream is then read to its end)."""
    started, first = time.perf_counter(), None
    async for response in stub.Generate(build_request(prompt, max_tokens=max_tokens, temperature=0.0,
                                                      ignore_eos=True), timeout=600):
        if first is None and response.WhichOneof("kind") == "chunk" and response.chunk.token_ids:
            first = time.perf_counter() - started
    assert first is not None
    return first


async def _answer(stub: gateway_pb2_grpc.GatewayServiceStub, prompt: list[int], max_tokens: int) -> list[int]:
    tokens: list[int] = []
    async for response in stub.Generate(build_request(prompt, max_tokens=max_tokens, temperature=0.0,
                                                      ignore_eos=True), timeout=600):
        if response.WhichOneof("kind") == "chunk":
            tokens += list(response.chunk.token_ids)
    return tokens


async def _ttft(disagg: str, local: str, suffixes: list[int], repeats: int, seed: int) -> dict[int, dict[str, list[float]]]:
    rng = random.Random(seed)
    results: dict[int, dict[str, list[float]]] = {n: {"disagg": [], "local": []} for n in suffixes}
    async with grpc.aio.insecure_channel(disagg) as a, grpc.aio.insecure_channel(local) as b:
        stubs = {"disagg": gateway_pb2_grpc.GatewayServiceStub(a), "local": gateway_pb2_grpc.GatewayServiceStub(b)}
        history = _tokens(rng, HISTORY)
        answer = await _answer(stubs["disagg"], history, ANSWER)  # both workers' caches now hold the history
        for repeat in range(repeats):
            for n in suffixes:
                order = ("disagg", "local") if repeat % 2 == 0 else ("local", "disagg")
                for variant in order:  # fresh tokens per turn: neither worker holds them
                    turn = history + answer + _tokens(rng, n)
                    results[n][variant].append(await _first_token_s(stubs[variant], turn, 2))
    return results


async def _itl(local: str, streams: int, suffix: int, seed: int) -> dict[str, list[float]]:
    """Chunk gaps of `streams` long decodes: while turns arrive back to back, and (after they stop) without."""
    rng = random.Random(seed)
    gaps: dict[str, list[float]] = {"with prefills": [], "alone": []}
    async with grpc.aio.insecure_channel(local) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        history = _tokens(rng, HISTORY)
        answer = await _answer(stub, history, ANSWER)
        arriving = asyncio.Event()

        async def stream(prompt: list[int]) -> None:
            last = None
            async for response in stub.Generate(build_request(prompt, max_tokens=600, temperature=0.0,
                                                              ignore_eos=True), timeout=600):
                if response.WhichOneof("kind") != "chunk" or not response.chunk.token_ids:
                    continue
                now = time.perf_counter()
                if last is not None:
                    gaps["with prefills" if arriving.is_set() else "alone"].append(now - last)
                last = now

        async def turns() -> None:
            await asyncio.sleep(2.0)  # the streams decode alone first
            arriving.set()
            for _ in range(6):
                await _first_token_s(stub, history + answer + _tokens(rng, suffix), 1)
            arriving.clear()

        await asyncio.gather(*(stream(_tokens(rng, 64)) for _ in range(streams)), turns())
    return gaps


def _ms(values: list[float]) -> str:
    return spread(values, 1000, " ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suffixes", default="16,64,128,256,512,1024")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--itl-suffix", type=int, default=512)
    add_common_arguments(parser, repeats=5)
    args = parser.parse_args()
    print_header("Conditional disaggregation: local prefill on the decode worker vs the prefill hop", args)
    suffixes = [int(n) for n in args.suffixes.split(",")]
    with tempfile.TemporaryDirectory() as logs:
        cluster, disagg, local = _start(str(args.model), 128, Path(logs))
        try:
            ttft = asyncio.run(_ttft(disagg, local, suffixes, args.repeats, seed=1))
            itl = {128: asyncio.run(_itl(local, args.streams, args.itl_suffix, seed=2))}
        finally:
            cluster.stop()
        Path(logs, "unbounded").mkdir()
        cluster, _, local = _start(str(args.model), 0, Path(logs, "unbounded"))
        try:
            itl[0] = asyncio.run(_itl(local, args.streams, args.itl_suffix, seed=2))
        finally:
            cluster.stop()
    print("\nTTFT of a turn (history 1,020 + answer 16 tokens held by the decode worker; N new tokens), median of "
          f"{args.repeats} interleaved, [min-max]:")
    print("| new tokens N | prefill worker (disagg) | decode worker (local) | local / disagg |")
    print("|---|---|---|---|")
    for n, runs in ttft.items():
        ratio = statistics.median(runs["local"]) / statistics.median(runs["disagg"])
        print(f"| {n} | {_ms(runs['disagg'])} | {_ms(runs['local'])} | {ratio:.2f} |")
    print(f"\nChunk gaps of {args.streams} decoding streams, alone vs while {args.itl_suffix}-token turns are prefilled "
          "on their decode worker (median, p90, max; count):")
    print("| decode --local-prefill-tokens-per-step | alone | with local prefills |")
    print("|---|---|---|")
    for bound, gaps in itl.items():
        cells = []
        for key in ("alone", "with prefills"):
            values = sorted(gaps[key])
            p90 = values[int(0.9 * (len(values) - 1))] if values else float("nan")
            cells.append(f"{statistics.median(values) * 1000:.1f} / {p90 * 1000:.1f} / {values[-1] * 1000:.1f} ms "
                         f"({len(values)})" if values else "-")
        print(f"| {bound or 'unbounded (0)'} | {cells[0]} | {cells[1]} |")
    print(f"\nload average at the end: {Path('/proc/loadavg').read_text().strip()}")


if __name__ == "__main__":
    main()
