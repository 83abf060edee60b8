"""Reserve latency while the decode worker is busy decoding (issue 18).

A DecodeService in this process (no gRPC) keeps --concurrency requests decoding (their KV marked complete
over zeroed pages, as a prefill transfer would; the tokens are meaningless, the steps are real). While the
engine steps, two variants take turns, each --samples back-to-back calls per run:
  Reserve                   DecodeService.reserve + release: allocated on the event loop under the engine's
                            pool lock (what the worker does now).
  engine-thread round trip  an empty command through the engine thread (EngineThread.call): what a Reserve
                            waited for when it allocated between engine steps (before issue 18).
Tables: median of --repeats interleaved runs of each variant's p50 / p90 / max latency, the engine step time,
and the load averages the runs ended at.

Run: .venv/bin/python -m benchmarks.bench_reserve --model models/pdserve-k3-tiny --threads 1
"""
from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

from benchmarks.common import Metrics, Table, add_common_arguments, interleave, load_note, median, print_header
from decode_worker.config import DecodeWorkerConfig
from decode_worker.server import _Receivers
from decode_worker.service import DecodeService
from engine.sampling_params import SamplingParams
from kvtransfer.destination import TransportKind
from kvtransfer.layout import KVLayout
from kvtransfer.shm_transport import ShmWriter


class BusyDecoder:
    """A DecodeService on its own event loop thread, kept decoding `concurrency` requests."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.loop = asyncio.new_event_loop()
        self.rng, self.gap_s = random.Random(args.seed), args.gap_ms / 1e3
        threading.Thread(target=self.loop.run_forever, name="bench-loop", daemon=True).start()
        self.receivers = _Receivers()
        config = DecodeWorkerConfig.build(model_dir=str(args.model), draft_model_dir="", attention_backend="torch",
                                          kv_memory_bytes=args.kv_memory_mb * 2**20, num_threads=args.threads,
                                          max_running=args.concurrency + 2)
        self.service = DecodeService(config, self.receivers)
        self.run(self.service.start())
        self.receivers.push.advertise(["127.0.0.1:1"] * len(self.receivers.pools))
        self.decodes = [asyncio.run_coroutine_threadsafe(self._decode(f"busy{i}", args.prompt_len, args.output_len),
                                                         self.loop) for i in range(args.concurrency)]
        deadline = time.monotonic() + 300
        while self.service.load.running < args.concurrency:
            failed = [decode.exception() for decode in self.decodes if decode.done()]
            if failed or time.monotonic() > deadline:
                raise RuntimeError(f"the busy requests did not all start: {failed or self.service.load}")
            time.sleep(0.05)

    def run(self, coroutine: Awaitable[Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()  # type: ignore[arg-type]

    async def _decode(self, request_id: str, prompt_len: int, output_len: int) -> None:
        service = self.service
        destination = await service.reserve(request_id, prompt_len, output_len, TransportKind.SHM)
        writer = ShmWriter(KVLayout.from_cache_shape(service.engine.cache_shape))
        try:
            for rank in range(destination.num_ranks):
                writer.open(destination, rank, in_place=True).finish()
        finally:
            writer.close()
        params = SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True)
        async for _ in service.decode(request_id, destination.lease_id, [5] * prompt_len, 7, params):
            pass

    def timed(self, call: Callable[[int], Awaitable[None]], samples: int) -> Metrics:
        async def measure() -> Metrics:
            steps, start = self.service.port.engine_steps, time.perf_counter()
            latencies: list[float] = []
            for index in range(samples):
                await asyncio.sleep(self.rng.uniform(0.0, self.gap_s))  # arrive at a random point of a step
                begin = time.perf_counter()
                await call(index)
                latencies.append(1e3 * (time.perf_counter() - begin))
            elapsed, stepped = time.perf_counter() - start, self.service.port.engine_steps - steps
            latencies.sort()
            return {"p50_ms": statistics.median(latencies), "p90_ms": latencies[int(0.9 * (len(latencies) - 1))],
                    "max_ms": latencies[-1], "step_ms": 1e3 * elapsed / stepped if stepped else float("nan"),
                    "running": float(self.service.load.running)}
        return self.run(measure())

    async def reserve(self, index: int) -> None:
        await self.service.reserve(f"probe{index}", 64, 16, TransportKind.SHM)
        await self.service.release(f"probe{index}")

    async def round_trip(self, index: int) -> None:
        await self.service._engine.call(lambda engine: None)

    def close(self) -> None:
        for decode in self.decodes:
            decode.cancel()
        self.run(self.service.stop())
        self.receivers.close()
        self.loop.call_soon_threadsafe(self.loop.stop)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_arguments(parser, repeats=5)
    parser.add_argument("--concurrency", type=int, default=16, help="requests kept decoding")
    parser.add_argument("--samples", type=int, default=40, help="calls per run")
    parser.add_argument("--gap-ms", type=float, default=30.0,
                        help="calls start a uniform random 0..gap apart (back to back, an engine-thread command "
                             "would slip in between steps right after the previous one)")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=4000, help="long enough to outlast the runs")
    parser.add_argument("--kv-memory-mb", type=int, default=256)
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.samples = 1, 10
    print_header("bench_reserve: Reserve latency while the decode worker is busy", args)
    busy = BusyDecoder(args)
    try:
        runs = interleave({"Reserve": lambda: busy.timed(busy.reserve, args.samples),
                           "engine-thread round trip": lambda: busy.timed(busy.round_trip, args.samples)}, args.repeats)
    finally:
        busy.close()
    table = Table(f"latency with {args.concurrency} requests decoding, {args.samples} calls per run, "
                  f"median of {args.repeats} interleaved runs",
                  ["variant", "p50 ms", "p90 ms", "max ms", "engine step ms", "running", "load average"])
    for name, samples in runs.items():
        table.add(name, median(samples, "p50_ms"), median(samples, "p90_ms"), median(samples, "max_ms"),
                  median(samples, "step_ms"), median(samples, "running"), load_note({name: samples}))
    table.print()


if __name__ == "__main__":
    main()
