"""Failover soak (issue 38, not in CI): a `pdserve up`-like deployment (1 prefill + 3 decode workers, supervisor
with hang watch) under mixed traffic for --minutes (default 10); every --every-s (120 s) one decode worker is
disturbed, alternating SIGKILL and SIGSTOP (SIGCONT --stop-s later). Prints failed requests that were not past
their own deadline (the goal: 0) and each decode worker's pages / leases / slots, each process's fds and RSS at
the start, after a warm-up of traffic (the baseline) and at the end (the goal: flat from the baseline), RSS split
into anonymous memory and the shared-memory KV pools it has touched.

  .venv/bin/python benchmarks/soak_failover.py [--minutes 10] [--model models/pdserve-tiny]
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import signal
import threading
import time
from pathlib import Path

import grpc
import psutil

from gateway.client import build_request, generate
from pdserve.hang_watch import HangPolicy, HangWatch
from pdserve.launcher import Cluster, ClusterSpec
from pdserve.supervisor import RestartPolicy, Supervisor
from rpc.internal.v1 import worker_pb2, worker_pb2_grpc

logger = logging.getLogger("soak")


async def _load(address: str) -> worker_pb2.GetDecodeLoadResponse | None:
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            return await worker_pb2_grpc.DecodeServiceStub(channel).GetDecodeLoad(worker_pb2.GetDecodeLoadRequest(),
                                                                                   timeout=5)
    except grpc.aio.AioRpcError:
        return None


async def _report(cluster: Cluster, label: str) -> None:
    lines = [f"== {label} (loadavg {open('/proc/loadavg').read().split()[:3]})"]
    for child in cluster.children:
        try:
            tree = [psutil.Process(child.process.pid), *psutil.Process(child.process.pid).children(recursive=True)]
            fds = sum(p.num_fds() for p in tree)
            rss = sum(p.memory_info().rss for p in tree) / 2**20
            kinds = _rss_kinds(tree)
            shm_fds = sum(_shm_fds(p.pid) for p in tree)
        except psutil.NoSuchProcess:
            fds, rss, kinds, shm_fds = -1, -1.0, {}, -1
        # RSS counts the shared-memory KV pools a process has touched (RssShmem: the prefill worker writes every
        # decode worker's pool in place, so it grows as traffic touches more pages); RssAnon is its own memory
        line = (f"{child.role:10s} fds {fds:4d} (shm {shm_fds:2d}) rss {rss:8.1f} MiB = anon {kinds.get('RssAnon', 0):7.1f}"
                f" + file {kinds.get('RssFile', 0):6.1f} + shmem {kinds.get('RssShmem', 0):7.1f}")
        if child.role.startswith("decode"):
            load = await _load(child.address)
            if load is not None:
                line += (f" free_pages {load.free_pages}/{load.total_pages} leases {load.leases} running {load.running}"
                         f" state_slots {load.free_state_slots}/{load.total_state_slots}")
        lines.append(line)
    print("\n".join(lines), flush=True)  # noqa: T201 - a benchmark's report


def _rss_kinds(tree: list[psutil.Process]) -> dict[str, float]:
    """RssAnon / RssFile / RssShmem of the processes, in MiB (/proc/PID/status)."""
    totals: dict[str, float] = {}
    for process in tree:
        for line in Path(f"/proc/{process.pid}/status").read_text().splitlines():
            name, _, value = line.partition(":")
            if name in ("RssAnon", "RssFile", "RssShmem"):
                totals[name] = totals.get(name, 0.0) + int(value.split()[0]) / 1024
    return totals


def _shm_fds(pid: int) -> int:
    """The process's open file descriptors on /dev/shm (KV pool segments)."""
    count = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            count += os.readlink(fd).startswith("/dev/shm/")
        except OSError:
            continue
    return count


async def _traffic(cluster: Cluster, stop: asyncio.Event, counts: dict[str, int]) -> None:
    rng = random.Random(0)
    async with grpc.aio.insecure_channel(cluster.gateway_address) as channel:
        from rpc.v1 import gateway_pb2_grpc

        stub = gateway_pb2_grpc.GatewayServiceStub(channel)

        async def one() -> None:
            prompt = [rng.randrange(3, 200) for _ in range(rng.randrange(4, 200))]
            greedy = rng.random() < 0.5
            request = build_request(prompt, max_tokens=rng.randrange(8, 200), temperature=0.0 if greedy else 0.8,
                                    ignore_eos=True)
            try:
                result = await generate(stub, request, timeout=120)
                ok = result.complete is not None
                code = "" if ok else grpc.StatusCode(next(c for c in grpc.StatusCode
                                                          if c.value[0] == result.error.code)).name
            except grpc.aio.AioRpcError as error:
                ok, code = False, error.code().name
            key = "ok" if ok else ("deadline" if code == "DEADLINE_EXCEEDED" else f"failed {code}")
            counts[key] = counts.get(key, 0) + 1

        running: set[asyncio.Task[None]] = set()
        while not stop.is_set():
            while len(running) < 8:
                task = asyncio.create_task(one())
                running.add(task)
                task.add_done_callback(running.discard)
            await asyncio.sleep(0.05)
        await asyncio.gather(*running)


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--every-s", type=float, default=120.0)
    parser.add_argument("--stop-s", type=float, default=20.0)
    parser.add_argument("--warmup-s", type=float, default=60.0,
                        help="traffic before the baseline report (first requests allocate the workers' buffers)")
    parser.add_argument("--model", default=str(Path(__file__).resolve().parents[1] / "models" / "pdserve-tiny"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    spec = ClusterSpec(model_dir=args.model, num_prefill=1, num_decode=3, listen="127.0.0.1:0",
                       worker_args=("--kv-memory-mb", "64", "--num-threads", "1"), log_level="WARNING")
    cluster = Cluster(spec)
    cluster.start(300)
    supervisor = Supervisor(cluster, RestartPolicy(max_restarts=20, backoff_initial_s=1),
                            hang_watch=HangWatch(HangPolicy(limit_s=60)))
    done = threading.Event()

    def supervise() -> None:
        while not done.wait(0.5):
            supervisor.check()

    watcher = threading.Thread(target=supervise, daemon=True)
    watcher.start()
    try:
        await _report(cluster, "start")
        stop, counts = asyncio.Event(), {}
        traffic = asyncio.create_task(_traffic(cluster, stop, counts))
        await asyncio.sleep(args.warmup_s)
        await _report(cluster, f"after {args.warmup_s:.0f} s of traffic (the baseline)")
        end, kill = time.monotonic() + args.minutes * 60, True
        while time.monotonic() + args.every_s < end:
            await asyncio.sleep(args.every_s)
            victim = random.choice([c for c in cluster.children if c.role.startswith("decode") and c.alive])
            if kill:
                os.killpg(victim.process.pid, signal.SIGKILL)
                print(f"SIGKILL {victim.role}; counts {counts}", flush=True)  # noqa: T201
            else:
                os.killpg(victim.process.pid, signal.SIGSTOP)
                print(f"SIGSTOP {victim.role}; counts {counts}", flush=True)  # noqa: T201
                await asyncio.sleep(args.stop_s)
                os.killpg(victim.process.pid, signal.SIGCONT)
            kill = not kill
        await asyncio.sleep(max(0.0, end - time.monotonic()))
        stop.set()
        await traffic
        await asyncio.sleep(5)  # the last requests' cleanup
        await _report(cluster, "end")
        print(f"requests: {counts}", flush=True)  # noqa: T201
    finally:
        done.set()
        watcher.join()
        cluster.stop()


if __name__ == "__main__":
    asyncio.run(main())
