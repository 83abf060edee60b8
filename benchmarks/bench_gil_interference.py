"""What a busy event loop in the same process costs the engine thread's decode steps (issue 18, item 2).

The decode worker steps its engine on one thread and serves gRPC on a uvloop event loop in the same process;
strace shows ~6 GIL hand-offs between them per streamed token, each time the loop's native gRPC / uvloop code
drops the GIL for a syscall and takes it back. This benchmark isolates that effect without gRPC: the engine
decodes greedy requests one at a time on a thread, with the main thread either idle or running a uvloop
that, per engine step (woken by call_soon_threadsafe as the decode worker's hand-over is), makes
--syscalls GIL-dropping pipe writes + reads and ~--python-us of Python work. The engine thread's CPU per
token (schedstat) and the times it was put on a CPU are compared round by round (interleaved): the ratio
bounds what moving the engine to its own process (or fewer loop wake-ups) could save per token.

Run: .venv/bin/python -m benchmarks.bench_gil_interference [--repeats 5] [--requests 4] [--syscalls 3]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import threading
import time
from typing import Any

import uvloop

from benchmarks.common import (Metrics, add_common_arguments, interleave, load_note, make_prompts, median, paired,
                               print_header, spread)
from engine import LLM, SamplingParams


def thread_schedstat() -> tuple[int, int]:
    """(CPU nanoseconds, times put on a CPU) of the calling thread."""
    fields = open(f"/proc/self/task/{threading.get_native_id()}/schedstat").read().split()
    return int(fields[0]), int(fields[2])


class LoopWork:
    """Per engine step, on the event loop: `syscalls` pipe round trips (each drops and retakes the GIL) and
    a Python loop of about `python_us` microseconds."""

    def __init__(self, syscalls: int, python_us: float) -> None:
        self._read, self._write = os.pipe()
        self._syscalls = syscalls
        self._iterations = max(0, int(python_us * 30))  # ~30 additions per microsecond of Python

    def __call__(self) -> None:
        for _ in range(self._syscalls):
            os.write(self._write, b"x")
            os.read(self._read, 1)
        total = 0
        for value in range(self._iterations):
            total += value

    def close(self) -> None:
        os.close(self._read)
        os.close(self._write)


def decode_on_thread(engine: Any, prompts: list[list[int]], params: SamplingParams,
                     loop: asyncio.AbstractEventLoop | None, work: LoopWork) -> Metrics:
    """Runs on the engine thread: every prompt to its end, one at a time; per step, wakes the loop (if any)."""
    tokens = len(prompts) * params.max_new_tokens
    cpu_start, scheduled_start = thread_schedstat()
    for index, prompt in enumerate(prompts):
        engine.add_request(f"gil-{time.monotonic_ns()}-{index}", list(prompt), params)
        while engine.has_work():
            engine.step()
            if loop is not None:
                loop.call_soon_threadsafe(work)
    cpu_end, scheduled_end = thread_schedstat()
    return {"cpu_ms_per_token": (cpu_end - cpu_start) / 1e6 / tokens,
            "scheduled_per_token": (scheduled_end - scheduled_start) / tokens}


def run_idle(engine: Any, prompts: list[list[int]], params: SamplingParams, work: LoopWork) -> Metrics:
    result: Metrics = {}
    thread = threading.Thread(target=lambda: result.update(decode_on_thread(engine, prompts, params, None, work)))
    thread.start()
    thread.join()
    return result


def run_busy(engine: Any, prompts: list[list[int]], params: SamplingParams, work: LoopWork) -> Metrics:
    async def main() -> Metrics:
        return await asyncio.to_thread(decode_on_thread, engine, prompts, params, asyncio.get_running_loop(), work)

    return uvloop.run(main())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_arguments(parser, repeats=5)
    parser.add_argument("--requests", type=int, default=4, help="requests per run (128 in / 64 out each)")
    parser.add_argument("--syscalls", type=int, default=3, help="GIL-dropping syscalls the loop makes per step")
    parser.add_argument("--python-us", type=float, default=60.0, help="microseconds of Python per step on the loop")
    parser.set_defaults(threads=1)
    args = parser.parse_args()
    print_header("bench_gil_interference: the engine thread beside a busy event loop", args)
    llm = LLM(str(args.model), attention_backend="torch", num_threads=args.threads, kv_memory_bytes=512 * 2**20)
    config = llm.model_config
    prompts, source = make_prompts(args.model, args.requests, 128, args.seed, config.vocab_size,
                                   list(config.eos_token_id))
    params = SamplingParams(temperature=0.0, max_new_tokens=64, ignore_eos=True, speculative=False)
    work = LoopWork(args.syscalls, args.python_us)
    try:
        runs = interleave({"idle main thread": lambda: run_idle(llm.engine, prompts, params, work),
                           "busy event loop": lambda: run_busy(llm.engine, prompts, params, work)}, args.repeats)
    finally:
        work.close()
    idle, busy = runs["idle main thread"], runs["busy event loop"]
    print(f"prompts: {source}; {args.requests} requests x 64 tokens per run; loop work per step: "
          f"{args.syscalls} pipe round trips + ~{args.python_us:.0f} us of Python\n")
    print("| main thread | engine CPU ms / token | engine thread scheduled in / token |\n|---|---:|---:|")
    for name, samples in runs.items():
        print(f"| {name} | {median(samples, 'cpu_ms_per_token'):.3f} | {median(samples, 'scheduled_per_token'):.2f} |")
    ratios = paired(busy, idle, "cpu_ms_per_token")
    print(f"\nengine CPU per token, busy / idle, per round: {spread(ratios, 100, '%')}; load {load_note(runs)}")


if __name__ == "__main__":
    main()
