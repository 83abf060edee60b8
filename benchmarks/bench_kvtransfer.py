"""KV handoff throughput: an 8k-token prompt in DeepSeek-V3's layout (61 layers x 576 bf16, ~549 MiB).

Rows (median of --repeat runs each, with the min-max spread; compared rows take turns):
  plain copy    torch copy_ of the same bytes between two local tensors (the floor for any copy)
  shm write     ShmWriter.push: memcpy into the mapped decode pool + per-layer checksum + completion record
  shm in-place  prefill ran its forward into the pool pages: only finish() (checksum + record)
  shm verify    decode's admit(): reading the record and re-hashing the pages
  raw grpc      1 MiB bytes messages, client-streamed over loopback; no protobuf, no pool, no checksum
  grpc push     GrpcWriter.push -> KVTransferService.Push into the decode process's shm pool (chunks, checksums,
                coverage), then admit
  device copy   DeviceWriter.push into a device pool (kvtransfer.device_pool): the copy a prefill rank on another
                device makes (on --device cuda a device-to-device copy on one GPU; on the CPU the memfd
                stand-in, i.e. a host memcpy)
  device in-place  prefill ran its forward into the IPC-mapped pool: only finish() (device sync + record)
The gRPC server runs in a child process (the decode worker), as in deployment: sender and receiver do
not share a GIL. Goals: shm write >= 70% of plain copy; grpc push >= 80% of raw grpc.

Run: .venv/bin/python benchmarks/bench_kvtransfer.py [--tokens 8192] [--repeat 7] [--device cpu|cuda]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent import futures

import grpc
import torch

from engine.cache.kv_cache import PagedLatentCache
from kvtransfer.checksum import DEFAULT_ALGORITHM
from kvtransfer.destination import Destination
from kvtransfer.grpc_receiver import PushReceiver
from kvtransfer.grpc_servicer import add_to_server
from kvtransfer.grpc_transport import GrpcWriter
from kvtransfer.layout import KVLayout
from kvtransfer.leases import LeaseTable
from kvtransfer.page_spans import byte_view
from kvtransfer.shm_pool import SharedPagePool
from kvtransfer.shm_receiver import ShmReceiver
from kvtransfer.shm_transport import ShmWriter
from rpc.internal.v1 import kv_pb2

LAYOUT = KVLayout(num_layers=61, latent_dim=512, rope_dim=64, page_size=64, dtype="bfloat16")
FIRST_PAGE = 16  # the request's pages in the decode pool start here (not at 0)
CHUNK = 1 << 20
identity = lambda data: data  # noqa: E731


def interleaved(repeat: int, rows: list[tuple[str, Callable[[], None], Callable[[], None]]]) -> list[tuple[str, list[float]]]:
    """Times of each (name, run, untimed setup) row; the rows take turns, so that every ratio compares
    runs made under the same background load."""
    times: dict[str, list[float]] = {name: [] for name, _, _ in rows}
    for _ in range(repeat):
        for name, run, setup in rows:
            setup()
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return list(times.items())


nothing = lambda: None  # noqa: E731


# --- decode side (child process) ----------------------------------------------------------------------
def serve(tokens: int) -> None:
    """Decode stand-in: an shm pool, a PushReceiver, the raw sink, and Reserve / Admit controls."""
    num_pages = LAYOUT.pages_for_tokens(tokens)
    pool = SharedPagePool.create(LAYOUT, FIRST_PAGE + num_pages + 16, owner_tag="bench")
    pool.tensor.view(torch.int16).fill_(1)  # steady state: the pool's pages are faulted in, as in a server
    receiver, leases = PushReceiver([pool.cache]), LeaseTable()

    def raw_push(request_iterator, context) -> bytes:
        return sum(len(message) for message in request_iterator).to_bytes(8, "little")

    def reserve(request: bytes, context) -> bytes:
        lease = leases.grant(f"g{time.monotonic_ns()}", range(FIRST_PAGE, FIRST_PAGE + num_pages), ttl_s=600)
        return receiver.expect(lease, tokens).to_proto().SerializeToString()

    def admit(request: bytes, context) -> bytes:
        return receiver.admit(request.decode(), timeout_s=30).bytes.to_bytes(8, "little")

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    add_to_server(receiver, server)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Control", {
        "RawPush": grpc.stream_unary_rpc_method_handler(raw_push),
        "Reserve": grpc.unary_unary_rpc_method_handler(reserve),
        "Admit": grpc.unary_unary_rpc_method_handler(admit),
    }),))
    port = server.add_insecure_port("127.0.0.1:0")
    receiver.advertise([f"127.0.0.1:{port}"])
    server.start()
    print(port, flush=True)
    sys.stdin.read()  # the parent closes stdin when done
    server.stop(0).wait()
    pool.close()
    pool.unlink()


# --- prefill side -----------------------------------------------------------------------------------
def grpc_rows(source: PagedLatentCache, source_pages: list[int], tokens: int, repeat: int) -> list[tuple[str, float]]:
    child = subprocess.Popen([sys.executable, __file__, "--serve", "--tokens", str(tokens)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port = int(child.stdout.readline())
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        raw = channel.stream_unary("/bench.Control/RawPush", request_serializer=identity, response_deserializer=identity)
        reserve = channel.unary_unary("/bench.Control/Reserve", request_serializer=identity, response_deserializer=identity)
        admit = channel.unary_unary("/bench.Control/Admit", request_serializer=identity, response_deserializer=identity)
        view = byte_view(source.buffer[: len(source_pages) * LAYOUT.bytes_per_page // LAYOUT.element_size])
        writer = GrpcWriter(LAYOUT)
        state: dict = {}

        def raw_stream() -> None:
            total = raw(bytes(view[start : start + CHUNK]) for start in range(0, len(view), CHUNK))
            assert int.from_bytes(total, "little") == len(view)

        def new_destination() -> None:
            state["destination"] = Destination.from_proto(kv_pb2.KVDestination.FromString(reserve(b"")))

        def push() -> None:
            destination = state["destination"]
            writer.push(source, source_pages, destination)
            assert int.from_bytes(admit(destination.request_id.encode()), "little") == len(view)

        raw_stream()  # warm the connection
        rows = interleaved(repeat, [("raw grpc", raw_stream, nothing), ("grpc push", push, new_destination)])
        writer.close()
        channel.close()
        return rows
    finally:
        child.stdin.close()
        child.wait(timeout=60)


def shm_rows(source: PagedLatentCache, source_pages: list[int], tokens: int, repeat: int) -> list[tuple[str, float]]:
    flat = source.buffer[: len(source_pages) * LAYOUT.bytes_per_page // LAYOUT.element_size]
    copy_target = torch.empty_like(flat)
    copy_target.copy_(flat)
    pool = SharedPagePool.create(LAYOUT, FIRST_PAGE + len(source_pages) + 16, owner_tag="bench")
    try:
        pool.tensor.view(torch.int16).fill_(1)
        receiver, writer, leases = ShmReceiver([pool]), ShmWriter(LAYOUT), LeaseTable()
        state: dict = {}

        def admit() -> None:
            receiver.admit(state.pop("destination").request_id)

        def next_request() -> None:  # admits the previous request (untimed), reserves the next
            if "destination" in state:
                admit()
            lease = leases.grant(f"s{time.monotonic_ns()}", range(FIRST_PAGE, FIRST_PAGE + len(source_pages)), 600)
            state["destination"] = receiver.expect(lease, tokens)

        def write() -> None:
            writer.push(source, source_pages, state["destination"])

        def write_next() -> None:
            next_request()
            write()

        rows = interleaved(repeat, [
            ("plain copy", lambda: copy_target.copy_(flat), nothing),
            ("shm write", write, next_request),
            ("shm in-place", lambda: writer.open(state["destination"], in_place=True).finish(), next_request),
            ("shm verify", admit, write_next),
        ])
        writer.close()
        return rows
    finally:
        pool.close()
        pool.unlink()


def device_rows(source: PagedLatentCache, source_pages: list[int], tokens: int, repeat: int,
                device: torch.device) -> list[tuple[str, list[float]]]:
    from engine.weights.device_ipc import ipc_for
    from kvtransfer.device_pool import DevicePagePool
    from kvtransfer.device_transport import DeviceReceiver, DeviceWriter

    local = PagedLatentCache(source.shape, source.buffer.to(device))
    pool = DevicePagePool.create(LAYOUT, FIRST_PAGE + len(source_pages) + 16, 0, "bench", device, ipc_for(device))
    try:
        receiver, writer, leases = DeviceReceiver([pool]), DeviceWriter(LAYOUT, device.type), LeaseTable()
        state: dict = {}

        def next_request() -> None:
            if "destination" in state:
                receiver.admit(state.pop("destination").request_id)
            lease = leases.grant(f"d{time.monotonic_ns()}", range(FIRST_PAGE, FIRST_PAGE + len(source_pages)), 600)
            state["destination"] = receiver.expect(lease, tokens)

        rows = interleaved(repeat, [
            ("device copy", lambda: writer.push(local, source_pages, state["destination"]), next_request),
            ("device in-place", lambda: writer.open(state["destination"], in_place=True).finish(), next_request),
        ])
        writer.close()
        return rows
    finally:
        pool.close()
        pool.unlink()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where the device-transport rows run")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.tokens)
        return

    num_pages = LAYOUT.pages_for_tokens(args.tokens)
    source = PagedLatentCache(LAYOUT.to_cache_shape(num_pages))
    source.buffer.view(torch.int16).random_(-(2**15), 2**15 - 1)
    source_pages = list(range(num_pages))
    nbytes = num_pages * LAYOUT.bytes_per_page
    rows = shm_rows(source, source_pages, args.tokens, args.repeat)
    rows += grpc_rows(source, source_pages, args.tokens, args.repeat)
    rows += device_rows(source, source_pages, args.tokens, args.repeat, torch.device(args.device))

    seconds = {name: statistics.median(times) for name, times in rows}
    print(f"KV of {args.tokens} tokens, {LAYOUT.num_layers} layers x {LAYOUT.entry_dim} {LAYOUT.dtype}: "
          f"{nbytes / 2**20:.1f} MiB; checksum {DEFAULT_ALGORITHM.name}; torch threads {torch.get_num_threads()}; "
          f"device rows on {args.device}; load average {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    print(f"{'path':<16}{'median ms':>10}{'min-max ms':>16}{'GiB/s':>8}   (n={args.repeat} each)")
    for name, times in rows:
        median = statistics.median(times)
        spread = f"{min(times) * 1e3:.1f}-{max(times) * 1e3:.1f}"
        print(f"{name:<16}{median * 1e3:>10.1f}{spread:>16}{nbytes / median / 2**30:>8.2f}")
    print(f"shm write / plain copy = {seconds['plain copy'] / seconds['shm write']:.0%} (goal >= 70%)")
    print(f"grpc push / raw grpc   = {seconds['raw grpc'] / seconds['grpc push']:.0%} (goal >= 80%)")


if __name__ == "__main__":
    main()
