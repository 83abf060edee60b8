"""Where a request's time to first token goes through the services at concurrency 1 (issue 18, item 3).

Starts 1 prefill + 1 decode worker and the gateway (TP 1, shm, torch attention, as profile_hops does) and
takes turns request by request (each variant first in turn), one request at a time, between
  gateway  a Generate through the gateway (128 prompt tokens, greedy, 4 output tokens): the client's TTFT;
  direct   the same first-token path driven by this script straight on the workers' sockets: Reserve on
           the decode worker, Prefill on the prefill worker (its PrefillTiming splits queue / engine
           forward / KV handoff before the reply: 0 on shm, whose completion record follows the reply),
           then Release (off the path, not counted).
Medians of each span, and the differences that name the hops:
  Prefill RPC - engine forward   the prefill worker's loop -> engine thread hop, handoff and response;
  gateway TTFT - Reserve - Prefill RPC   the gateway's own work (request parsing, tokenisation, routing, the
                                 RequestRun task, events queue, servicer) plus the client's own hop (a gateway
                                 with standing leases, the default, pays no Reserve: this then reads Reserve less).
and the CPU each process spent per request in each variant (psutil, whole process: all its threads).
Wall spans on a loaded machine are inflated: trust the proportions and the CPU.

--gateway-args passes flags to the gateway (e.g. "--standing-lease-tokens 0": no spares); --compare FLAGS starts a second
gateway on the same workers with those flags and takes turns between the two gateways too (before/after in one
run), printing the paired per-turn TTFT difference.

Run: .venv/bin/python -m benchmarks.ttft_spans [--requests 30] [--rounds 3] [--compare="--standing-lease-tokens 0"]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import grpc
import psutil

from bench.client import GatewayClient, SamplingOptions
from bench.workload import BenchRequest
from benchmarks.profile_hops import thread_usage
from benchmarks.common import DEFAULT_MODEL, machine_description, make_prompts, timed_generate
from engine import LLM
from engine.models.registry import load_config
from engine.sampling_params import SamplingParams
from gateway.prefill_stream import PrefillStream
from pdserve.launcher import Child, Cluster, ClusterSpec, read_ready_file
from rpc.convert import sampling_to_proto
from rpc.internal.v1 import kv_pb2, worker_pb2, worker_pb2_grpc

Spans = dict[str, list[float]]
GREEDY = sampling_to_proto(SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True))


async def gateway_ttft(client: GatewayClient, prompt: list[int], output_len: int) -> float:
    record = await client.send(BenchRequest(output_len=output_len, ignore_eos=True, token_ids=tuple(prompt)))
    if not record.success:
        raise RuntimeError(f"request failed: {record.error}")
    return record.ttft_s * 1e3


async def direct_path(decode: worker_pb2_grpc.DecodeServiceStub, prefill: PrefillStream,
                      prompt: list[int], spans: Spans) -> None:
    """Reserve -> Prefill straight on the workers (what the gateway does before its first token: the prompt
    over a PrefillStream), timed."""
    request_id = f"spans-{uuid.uuid4().hex[:12]}"
    start = time.perf_counter()
    reserved = await decode.Reserve(worker_pb2.ReserveRequest(
        request_id=request_id, num_prompt_tokens=len(prompt), max_new_tokens=4, transport=kv_pb2.TRANSPORT_SHM),
        timeout=30)
    middle = time.perf_counter()
    response = await prefill.prefill(worker_pb2.PrefillRequest(
        request_id=request_id, token_ids=prompt, destination=reserved.destination, sampling=GREEDY), 60)
    end = time.perf_counter()
    await decode.Release(worker_pb2.ReleaseRequest(request_id=request_id), timeout=30)
    spans["Reserve RPC"].append((middle - start) * 1e3)
    spans["Prefill RPC"].append((end - middle) * 1e3)
    spans["  prefill queue"].append(response.timing.queue_ms)
    spans["  engine forward"].append(response.timing.prefill_ms)
    spans["  KV handoff before reply"].append(response.timing.transfer_ms)


def cpu_s(pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds of each process and its children (every thread's schedstat: ns, not 10 ms ticks)."""
    out: dict[str, float] = {}
    for role, pid in pids.items():
        family = [pid, *(child.pid for child in psutil.Process(pid).children(recursive=True))]
        out[role] = sum(cpu for member in family for cpu, _, _ in thread_usage(member, {}).values())
    return out


def start_gateway(cluster: Cluster, name: str, flags: list[str]) -> Child:
    """A further gateway on the cluster's workers (same command as the first, plus flags)."""
    command = list(cluster.children[-1].command)
    args = command[command.index("gateway") + 1:]
    ready = Path(tempfile.mkdtemp(prefix="ttft-spans-")) / f"{name}.addr"
    args[args.index("--ready-file") + 1] = str(ready)
    args[args.index("--listen") + 1] = "127.0.0.1:0"
    if "--http-listen" in args and args[args.index("--http-listen") + 1]:
        args[args.index("--http-listen") + 1] = "127.0.0.1:0"
    child = Child(name, cluster._popen([*command[:command.index("gateway") + 1], *args, *flags], None), ready)
    deadline = time.monotonic() + 300
    while not ready.is_file():
        if child.process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"gateway {name} did not start")
        time.sleep(0.1)
    child.address = read_ready_file(str(ready))[0]
    return child


def in_process_ttft(llm: LLM, prompt: list[int]) -> float:
    """The in-process engine's TTFT for the prompt (add_request -> the step that produced the first token), ms."""
    run = timed_generate(llm.engine, [prompt], SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True))
    return run.ttft_s[0] * 1e3


async def measure(args: argparse.Namespace, gateways: dict[str, str], decode: str, prefill: str,
                  pids: dict[str, int], prompts: list[list[int]], llm: LLM | None) -> None:
    channels = {name: grpc.aio.insecure_channel(address) for name, address in gateways.items()}
    clients = {name: GatewayClient(channel, SamplingOptions(temperature=0.0, speculative=False))
               for name, channel in channels.items()}
    decode_channel, prefill_channel = grpc.aio.insecure_channel(decode), grpc.aio.insecure_channel(prefill)
    decode_stub = worker_pb2_grpc.DecodeServiceStub(decode_channel)
    prefill_stub = PrefillStream(worker_pb2_grpc.PrefillServiceStub(prefill_channel), (), prefill)
    variants = [*gateways, "direct", *(["in process"] if llm is not None else [])]
    spans: Spans = {key: [] for key in ("Reserve RPC", "Prefill RPC", "  prefill queue", "  engine forward",
                                        "  KV handoff before reply", *(["in-process TTFT"] if llm is not None else []))}
    ttft: dict[str, list[float]] = {name: [] for name in gateways}
    cpu: dict[str, dict[str, float]] = {variant: dict.fromkeys(pids, 0.0) for variant in variants}
    try:
        for prompt in prompts[:4]:  # warm-up: channels, first forwards
            for name, client in clients.items():
                await gateway_ttft(client, prompt, args.output_len)
            await direct_path(decode_stub, prefill_stub, prompt, {key: [] for key in spans})
            if llm is not None:
                in_process_ttft(llm, prompt)
        for round_index in range(args.rounds):
            for number, prompt in enumerate(prompts):
                shift = (round_index + number) % len(variants)  # each variant goes first in turn
                for variant in variants[shift:] + variants[:shift]:
                    before = cpu_s(pids)
                    if variant == "direct":
                        await direct_path(decode_stub, prefill_stub, prompt, spans)
                    elif variant == "in process":
                        spans["in-process TTFT"].append(in_process_ttft(llm, prompt))
                    else:
                        ttft[variant].append(await gateway_ttft(clients[variant], prompt, args.output_len))
                    after = cpu_s(pids)
                    for role in pids:
                        cpu[variant][role] += (after[role] - before[role]) * 1e3 / (len(prompts) * args.rounds)
    finally:
        await prefill_stub.close()
        for channel in (*channels.values(), decode_channel, prefill_channel):
            await channel.close()
    report(spans, ttft, cpu, args)


def report(spans: Spans, ttft: dict[str, list[float]], cpu: dict[str, dict[str, float]], args) -> None:
    def med(values: list[float]) -> float:
        return statistics.median(values)

    print(f"\nwall spans, median (p10..p90) ms over {args.requests} x {args.rounds} requests, {args.input_len} prompt "
          f"tokens, load average {os.getloadavg()[0]:.1f} at the end:")
    rows = {**{f"gateway TTFT [{name}]": values for name, values in ttft.items()}, **spans}
    for name, values in rows.items():
        deciles = statistics.quantiles(values, n=10)
        print(f"  {name:28s} {med(values):7.2f}  ({deciles[0]:.2f}..{deciles[-1]:.2f})")
    prefill_rpc = med(spans["Prefill RPC"])
    engine = med(spans["  engine forward"])
    print(f"  {'prefill non-engine':28s} {prefill_rpc - engine:7.2f}  (Prefill RPC - engine forward)")
    for name, values in ttft.items():
        print(f"  {'gateway own [' + name + ']':28s} {med(values) - med(spans['Reserve RPC']) - prefill_rpc:7.2f}  "
              f"(TTFT - Reserve RPC - Prefill RPC)")
        print(f"  {'added TTFT [' + name + ']':28s} {med(values) - engine:7.2f}  "
              f"(TTFT - engine forward)")
        if "in-process TTFT" in spans:  # as bench_gateway counts it: against the engine in this process
            paired = [a - b for a, b in zip(values, spans["in-process TTFT"])]
            print(f"  {'vs in process [' + name + ']':28s} {med(paired):7.2f}  (TTFT - in-process TTFT, paired)")
    names = list(ttft)
    for name in names[1:]:  # the same prompt in the same turn: paired differences cancel the load's drift
        paired = [b - a for a, b in zip(ttft[names[0]], ttft[name])]
        quartiles = statistics.quantiles(paired, n=4)
        print(f"  {'TTFT ' + name + ' - ' + names[0]:28s} {med(paired):7.2f}  ({quartiles[0]:.2f}..{quartiles[-1]:.2f} "
              f"quartiles of the paired differences)")
    print(f"\nCPU ms per request by process (gateway variants: {args.output_len} output tokens, incl. Decode):")
    roles = list(next(iter(cpu.values())))
    print("| variant | " + " | ".join(roles) + " |\n|---|" + "---:|" * len(roles))
    for variant, row in cpu.items():
        print(f"| {variant} | " + " | ".join(f"{row[role]:.2f}" for role in roles) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--requests", type=int, default=30, help="requests per variant and round")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--gateway-args", default="", help="extra flags for the gateway (one string)")
    parser.add_argument("--compare", default=None, help="flags of a second gateway to compare (one string)")
    parser.add_argument("--in-process", action="store_true",
                        help="also take turns with the engine in this process (its TTFT, as bench_gateway counts it)")
    args = parser.parse_args()
    print(f"machine: {machine_description()}", flush=True)
    spec = ClusterSpec(model_dir=str(args.model), listen="127.0.0.1:0", attention_backend="torch", transport="shm",
                       worker_args=("--num-threads", str(args.threads), "--kv-memory-mb", "512"), log_level="WARNING",
                       gateway_args=tuple(shlex.split(args.gateway_args)))
    cluster = Cluster(spec, log_dir=Path(tempfile.mkdtemp(prefix="ttft-spans-")))
    gateways = {"gateway": cluster.start(timeout_s=300)}
    extra: Child | None = None
    try:
        roles = {child.role.split("-")[0]: child for child in cluster.children}
        pids = {role: child.process.pid for role, child in roles.items()}
        if args.compare is not None:
            extra = start_gateway(cluster, "gateway-b", shlex.split(args.compare))
            gateways["gateway-b"] = extra.address
            pids["gateway-b"] = extra.process.pid
        config = load_config(str(args.model))
        prompts, source = make_prompts(args.model, args.requests, args.input_len, 0, config.vocab_size,
                                       list(config.eos_token_id))
        print(f"prompts: {source}; gateways: {gateways}", flush=True)
        llm = (LLM(str(args.model), attention_backend="torch", num_threads=args.threads, kv_memory_bytes=512 * 2**20)
               if args.in_process else None)
        asyncio.run(measure(args, gateways, roles["decode"].address, roles["prefill"].address, pids, prompts, llm))
    finally:
        if extra is not None:
            extra.process.terminate()
            extra.process.wait(30)
        cluster.stop()


if __name__ == "__main__":
    main()
