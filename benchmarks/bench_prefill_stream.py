"""The Prefill hop alone: unary Prefill calls vs the gateway's PrefillStream (issue 18, item 3).

A prefill worker runs in a child process with the real servicer and PrefillService over an engine that answers
at once (no forward: what is left is the gRPC hop, the servicer, the queue, the engine-thread hop and the
shm completion record); this process plays the decode side (one shm pool: reserve pages, then free them) and
the gateway (gateway.prefill_stream.PrefillStream, or the unary stub). Requests go one at a time, the two
variants alternating request by request, so drifts of the shared machine hit both alike. Per repetition:
median latency of each variant, the paired per-request difference, and the CPU per request of this process
and of the worker (psutil; the variants share both processes, so CPU is measured in separate blocks).

Run: .venv/bin/python -m benchmarks.bench_prefill_stream [--requests 200] [--repeats 5]"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import statistics
import time
from types import SimpleNamespace
from typing import Any

import grpc
import psutil

from benchmarks.common import machine_description, spread
from engine.kv_cache import PageAllocator
from engine.sampling_params import SamplingParams
from gateway.prefill_stream import PrefillStream
from kvtransfer.layout import KVLayout
from kvtransfer.leases import LeaseTable
from kvtransfer.shm_pool import SharedPagePool
from kvtransfer.shm_receiver import ShmReceiver
from rpc.convert import sampling_to_proto
from rpc.internal.v1 import worker_pb2, worker_pb2_grpc

LAYOUT = KVLayout(num_layers=2, latent_dim=16, rope_dim=4, page_size=16, dtype="float32")
SAMPLING = sampling_to_proto(SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True))


class _InstantEngine:
    """Answers every prompt with its first token at once (the KV is taken as written in place)."""

    config = SimpleNamespace(tp_size=1, page_size=LAYOUT.page_size)
    cache_shape = LAYOUT.to_cache_shape(8)

    def validate_prompt(self, prompt_ids: list[int]) -> None:
        pass

    def prefill(self, jobs: list[Any], should_stop: Any = None) -> list[Any]:
        from engine.llm_engine import PrefillResult

        return [PrefillResult(job.request_id, job.prompt_ids[0], None, len(job.prompt_ids), 0.0) for job in jobs]

    def close(self) -> None:
        pass


def _worker(address_pipe: Any) -> None:
    """The child: a prefill worker server on 127.0.0.1:0 until killed (its port goes back through the pipe)."""
    from prefill_worker.config import PrefillWorkerConfig
    from prefill_worker.service import PrefillService
    from prefill_worker.servicer import PrefillServicer
    from rpc.interceptors import server_interceptors
    from rpc.server import SERVER_OPTIONS, run

    async def main() -> None:
        service = PrefillService(PrefillWorkerConfig.build(), engine_factory=_InstantEngine)
        await service.start()
        server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=list(server_interceptors(None)))
        worker_pb2_grpc.add_PrefillServiceServicer_to_server(PrefillServicer(service), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        address_pipe.send(port)
        await asyncio.Event().wait()

    run(main)


async def _one(send: Any, pool: Any, index: int, tokens: int) -> float:
    """One prefill through `send`, its wall time in ms; the pages are freed once the record is written."""
    receiver, allocator, leases = pool
    request_id = f"r{index}"
    pages = allocator.allocate(LAYOUT.pages_for_tokens(tokens))
    destination = receiver.expect(leases.grant(request_id, pages, 60), tokens)
    request = worker_pb2.PrefillRequest(request_id=request_id, token_ids=[5] * tokens, sampling=SAMPLING,
                                        destination=destination.to_proto())
    start = time.perf_counter()
    response = await send(request)
    elapsed = (time.perf_counter() - start) * 1e3
    assert response.first_token == 5
    deadline = time.monotonic() + 10
    while not receiver.ready(request_id):  # off the timed path: the record follows the reply
        assert time.monotonic() < deadline, "no completion record"
        await asyncio.sleep(0.0005)
    receiver.cancel(request_id)
    allocator.free(pages)
    return elapsed


async def measure(args: argparse.Namespace, port: int, worker: psutil.Process) -> None:
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = worker_pb2_grpc.PrefillServiceStub(channel)
    stream = PrefillStream(stub, (), "bench")
    variants = {"unary": lambda r: stub.Prefill(r, timeout=30), "stream": lambda r: stream.prefill(r, 30)}
    me = psutil.Process()
    with SharedPagePool.create(LAYOUT, 256, num_slots=8) as shm:
        pool = (ShmReceiver([shm]), PageAllocator(256), LeaseTable(grace_s=0))
        counter = iter(range(10**9))
        for name in variants:  # warm-up: channel, stream, engine thread
            for _ in range(20):
                await _one(variants[name], pool, next(counter), args.tokens)
        rows: dict[str, list[float]] = {"unary": [], "stream": [], "diff": [], "cpu unary": [], "cpu stream": [],
                                        "worker cpu unary": [], "worker cpu stream": []}
        for repeat in range(args.repeats):
            times: dict[str, list[float]] = {name: [] for name in variants}
            for index in range(args.requests):  # alternating request by request
                order = list(variants) if (index + repeat) % 2 == 0 else list(reversed(variants))
                for name in order:
                    times[name].append(await _one(variants[name], pool, next(counter), args.tokens))
            for name in variants:
                rows[name].append(statistics.median(times[name]))
            rows["diff"].append(statistics.median(a - b for a, b in zip(times["unary"], times["stream"])))
            for name in variants:  # CPU in blocks: both variants share the processes
                mine, theirs = sum(me.cpu_times()[:2]), sum(worker.cpu_times()[:2])
                for _ in range(args.requests):
                    await _one(variants[name], pool, next(counter), args.tokens)
                rows[f"cpu {name}"].append((sum(me.cpu_times()[:2]) - mine) * 1e3 / args.requests)
                rows[f"worker cpu {name}"].append((sum(worker.cpu_times()[:2]) - theirs) * 1e3 / args.requests)
            print(f"  repetition {repeat + 1}: unary {rows['unary'][-1]:.3f} ms, stream {rows['stream'][-1]:.3f} ms, "
                  f"load {os.getloadavg()[0]:.1f}", flush=True)
    await stream.close()
    await channel.close()
    print(f"\nmedian over {args.repeats} repetitions of {args.requests} requests each (min..max), "
          f"{args.tokens}-token prompts, load average {os.getloadavg()[0]:.1f} at the end:")
    for name, label in (("unary", "Prefill hop, unary"), ("stream", "Prefill hop, stream"),
                        ("diff", "paired unary - stream"), ("cpu unary", "gateway side CPU/req, unary"),
                        ("cpu stream", "gateway side CPU/req, stream"), ("worker cpu unary", "worker CPU/req, unary"),
                        ("worker cpu stream", "worker CPU/req, stream")):
        print(f"  {label:30s} {spread(rows[name], 1000, ' us')}")

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200, help="requests per variant and repetition")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved repetitions")
    parser.add_argument("--tokens", type=int, default=128, help="prompt tokens per request")
    args = parser.parse_args()
    print(f"machine: {machine_description()}", flush=True)
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_worker, args=(send,), daemon=True)
    child.start()
    try:
        if not receive.poll(120):
            raise RuntimeError("the prefill worker did not start")
        asyncio.run(measure(args, receive.recv(), psutil.Process(child.pid)))
    finally:
        child.terminate()
        child.join(30)


if __name__ == "__main__":
    main()
