"""KDA state handoff time (issue 14 item 3): one request's state slot moving from prefill to decode, over shm
and gRPC, for the tiny K3 of the tests (TP=2) and for real Kimi K3 at decode TP8 (K3_SPEC numbers).

A request is one latent page plus (with state) its state slot, on one rank. Each path is timed end to end
(shm: memcpy into the decode pool + checksum + completion record, then decode's admit re-hashing it; grpc:
GrpcWriter.push of 1 MiB checksummed chunks over loopback into the pool + admit). The same request without
state runs beside it (interleaved), so "state" = median(with) - median(without). The gRPC server runs in
this process (it shares the GIL with the sender: a pessimistic figure; bench_kvtransfer.py uses a child).

Run: .venv/bin/python -m benchmarks.bench_state_handoff [--repeats 7]
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import statistics
import time

import torch

from benchmarks.common import interleave, machine_description
from engine.cache.kv_cache import PagedLatentCache
from kvtransfer.grpc_receiver import PushReceiver
from kvtransfer.grpc_servicer import serve
from kvtransfer.grpc_transport import GrpcWriter
from kvtransfer.layout import KVLayout, StateLayout
from kvtransfer.leases import LeaseTable
from kvtransfer.shm_pool import SharedPagePool
from kvtransfer.shm_receiver import ShmReceiver
from kvtransfer.shm_transport import ShmWriter

TINY_K3_TP2 = KVLayout(num_layers=2, latent_dim=32, rope_dim=4, page_size=16, dtype="float32", state=StateLayout(
    state_layers=6, conv_width=3, conv_channels=3 * 12 * 8, state_heads=12, head_k_dim=8, head_v_dim=8,
    conv_dtype="float32", ssm_dtype="float32"))
K3_TP8 = KVLayout(num_layers=24, latent_dim=512, rope_dim=64, page_size=64, dtype="bfloat16", state=StateLayout(
    state_layers=69, conv_width=3, conv_channels=3 * 12 * 128, state_heads=12, head_k_dim=128, head_v_dim=128,
    conv_dtype="bfloat16", ssm_dtype="float32"))
_ids = itertools.count()


def _without_state(layout: KVLayout) -> KVLayout:
    return dataclasses.replace(layout, state=None)


def _source(layout: KVLayout) -> PagedLatentCache:
    cache = PagedLatentCache(layout.to_cache_shape(2, 1 if layout.has_state else 0))
    cache.buffer.view(torch.uint8).random_(0, 256)
    return cache


class _Path:
    """One transport for one layout: a decode pool of 4 pages (+ 2 slots), a receiver and a writer."""

    def __init__(self, layout: KVLayout, transport: str) -> None:
        self.layout, self.transport = layout, transport
        self.pool = SharedPagePool.create(layout, 4, num_state_slots=2 if layout.has_state else 0)
        self.source, self.leases = _source(layout), LeaseTable()
        if transport == "shm":
            self.receiver, self.writer, self.server = ShmReceiver([self.pool]), ShmWriter(layout), None
        else:
            self.receiver = PushReceiver([self.pool.cache])
            self.server, port = serve(self.receiver)
            self.receiver.advertise([f"127.0.0.1:{port}"])
            self.writer = GrpcWriter(layout)

    def run(self) -> dict[str, float]:
        request = f"b{next(_ids)}"
        lease = self.leases.grant(request, (1,), 600, state_slot=1 if self.layout.has_state else None)
        destination = self.receiver.expect(lease, self.layout.page_size)
        slot = 0 if self.layout.has_state else None
        start = time.perf_counter()
        self.writer.push(self.source, [0], destination, 0, source_state_slot=slot)
        self.receiver.admit(request, timeout_s=60)
        return {"ms": (time.perf_counter() - start) * 1e3}

    def close(self) -> None:
        self.writer.close()
        if self.server is not None:
            self.server.stop(0).wait()
        self.pool.close()
        self.pool.unlink()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    print("# KDA state handoff\n")
    print(f"machine: {machine_description()}  ")
    print(f"repeats: {args.repeats} (interleaved; medians, spread = min..max)\n")
    print("| layout | state B / request / rank | ranks | state B / request | path | with state ms | without ms "
          "| state ms (median diff) | spread with ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, layout, ranks in (("tiny K3, TP=2", TINY_K3_TP2, 2), ("Kimi K3, TP8", K3_TP8, 8)):
        for transport in ("shm", "grpc"):
            paths = {"with": _Path(layout, transport), "without": _Path(_without_state(layout), transport)}
            try:
                samples = interleave({key: path.run for key, path in paths.items()}, args.repeats)
            finally:
                for path in paths.values():
                    path.close()
            with_ms = [s["ms"] for s in samples["with"]]
            without_ms = [s["ms"] for s in samples["without"]]
            diff = statistics.median(with_ms) - statistics.median(without_ms)
            print(f"| {name} | {layout.state_bytes:,} | {ranks} | {layout.state_bytes * ranks:,} | {transport} "
                  f"| {statistics.median(with_ms):.2f} | {statistics.median(without_ms):.2f} | {diff:.2f} "
                  f"| {min(with_ms):.2f}..{max(with_ms):.2f} |", flush=True)
    print(f"\nload average at end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
