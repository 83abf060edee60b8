"""Profiles the live services under load with py-spy (issue 18, deliverable 2).

Starts 1 prefill + 1 decode worker and the gateway (TP 1, shm, torch attention, as bench_gateway does),
drives a closed loop of greedy requests through the gateway at --concurrency, and meanwhile runs
`py-spy record` on the chosen service processes (all threads, native frames off, idle samples
dropped). Writes one speedscope/flamegraph/raw file per role and prints each profile's top functions by
own and total samples, so the hot spots read in a terminal.

Also prints where a request's time goes (reserve, prefill with its queue / compute / handoff, TTFT, decode
set-up, end to end: means from the services' /metrics histograms over the load), and each service's CPU
per output token by thread (the engine thread, the event loop, gRPC's threads), read from
/proc/<pid>/task with py-spy's thread names, over the whole load.

Run: .venv/bin/python -m benchmarks.profile_services [--roles decode gateway] [--concurrency 16]
     [--seconds 20] [--native] [--gil] [--out DIR]
Needs py-spy (the dev extra) and permission to ptrace the services (py-spy reports it when refused).
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import grpc

from bench.client import GatewayClient, SamplingOptions
from bench.load import LoadPlan, run_load
from bench.workload import BenchRequest
from benchmarks.common import DEFAULT_MODEL, make_prompts, machine_description
from engine.models.registry import load_config
from pdserve.launcher import Cluster, ClusterSpec
from prefill_worker.batch_policy import DEFAULT_BATCH_TARGET_MS


def summarise(raw_file: Path, top: int) -> str:
    """py-spy's raw (collapsed stack) output -> the top functions by own samples and by total samples."""
    own: collections.Counter[str] = collections.Counter()
    total: collections.Counter[str] = collections.Counter()
    samples = 0
    for line in raw_file.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        samples += count
        frames = stack.split(";")
        own[frames[-1]] += count
        for frame in set(frames):
            total[frame] += count
    lines = [f"{samples} samples"]
    for title, counter in (("own", own), ("total", total)):
        lines.append(f"top {top} by {title} samples:")
        for frame, count in counter.most_common(top):
            lines.append(f"  {100 * count / max(samples, 1):5.1f}%  {frame}")
    return "\n".join(lines)


def python_thread_names(py_spy: str, pid: int) -> dict[int, str]:
    """Native thread id -> Python thread name, from `py-spy dump` (threads Python did not start are absent)."""
    dump = subprocess.run([py_spy, "dump", "--pid", str(pid), "--nonblocking"], capture_output=True, text=True,
                          timeout=60).stdout
    return {int(tid): name for tid, name in re.findall(r'^Thread (\d+) \([a-z-]+\): "(.*)"$', dump, re.MULTILINE)}


def thread_cpu(pid: int, names: dict[int, str]) -> dict[str, float]:
    """CPU seconds (user + system) of each thread of a process, summed by thread name: the Python name
    where known, else the OS name (/proc/<pid>/task/<tid>/stat)."""
    ticks = os.sysconf("SC_CLK_TCK")
    totals: collections.Counter[str] = collections.Counter()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue  # the thread ended meanwhile
        name = names.get(int(task.name)) or "os:" + stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        totals[name] += (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
    return dict(totals)


def thread_table(before: dict[str, float], after: dict[str, float], tokens: int) -> str:
    rows = sorted(((after[name] - before.get(name, 0.0), name) for name in after), reverse=True)
    total = sum(spent for spent, _ in rows)
    lines = [f"CPU per output token by thread ({tokens} tokens): {1e3 * total / max(tokens, 1):.3f} ms in all"]
    lines += [f"  {1e3 * spent / max(tokens, 1):8.3f} ms  {name}" for spent, name in rows if spent > 0]
    return "\n".join(lines)


STEP_COUNTERS = ("pdserve_decode_engine_steps_total", "pdserve_decode_engine_step_tokens_total")
# Where a request's time goes (histograms; role, metric, what it covers), in path order.
PHASES = (
    ("gateway", "pdserve_request_queue_time_seconds", "arrival -> reserved (Reserve on the decode worker)"),
    ("gateway", "pdserve_request_prefill_seconds", "reserved -> prefill answered (the Prefill call)"),
    ("prefill", "pdserve_prefill_queue_time_seconds", "  of which: queued on the prefill worker"),
    ("prefill", "pdserve_prefill_compute_seconds", "  of which: the engine's prefill step"),
    ("prefill", "pdserve_kv_transfer_seconds", "  of which: KV handoff (completion records)"),
    ("gateway", "pdserve_time_to_first_token_seconds", "arrival -> first token (TTFT at the gateway)"),
    ("gateway", "pdserve_request_decode_setup_seconds", "first token -> first decode chunk (Decode call)"),
    ("gateway", "pdserve_e2e_request_latency_seconds", "arrival -> last token"),
)


def scrape(address: str, names: tuple[str, ...]) -> dict[str, float]:
    """The named samples of a service's GET /metrics (labels summed away)."""
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=30).read().decode()
    found: collections.Counter[str] = collections.Counter()
    for name, value in re.findall(r"^(\w+)(?:\{[^}]*\})? ([0-9.e+-]+)$", text, re.MULTILINE):
        if name in names:
            found[name] += float(value)
    return dict(found)


def scrape_phases(addresses: dict[str, str]) -> dict[str, float]:
    """The _sum and _count of every PHASES histogram, from the gateway and prefill-0 metrics endpoints."""
    values: dict[str, float] = {}
    for role, address in (("gateway", addresses["gateway"]), ("prefill", addresses["prefill-0"])):
        names = tuple(f"{metric}_{part}" for who, metric, _ in PHASES if who == role for part in ("sum", "count"))
        values.update(scrape(address, names))
    return values


def phase_table(before: dict[str, float], after: dict[str, float]) -> str:
    """Mean milliseconds per request of each phase over the load (the difference of two scrapes)."""
    lines = ["where a request's time goes (mean per request over the load, wall clock):"]
    for _, metric, meaning in PHASES:
        count = after.get(f"{metric}_count", 0.0) - before.get(f"{metric}_count", 0.0)
        total = after.get(f"{metric}_sum", 0.0) - before.get(f"{metric}_sum", 0.0)
        mean = f"{1000 * total / count:9.1f} ms" if count else "        -   "
        lines.append(f"  {mean}  {meaning}  ({count:.0f} requests)")
    return "\n".join(lines)


async def drive(address: str, prompts: list[list[int]], output_len: int, concurrency: int, stop: threading.Event) -> int:
    channel = grpc.aio.insecure_channel(address)
    client = GatewayClient(channel, SamplingOptions(temperature=0.0, speculative=False))
    requests = [BenchRequest(output_len=output_len, ignore_eos=True, token_ids=tuple(p)) for p in prompts]
    tokens = 0
    try:
        while not stop.is_set():
            outcome = await run_load(requests, client.send, LoadPlan(max_concurrency=concurrency))
            failed = [r.error for r in outcome.records if not r.success]
            if failed:
                raise RuntimeError(f"{len(failed)} requests failed, first: {failed[0]}")
            tokens += sum(r.output_tokens for r in outcome.records)
    finally:
        await channel.close()
    return tokens


def find_py_spy() -> str:
    beside = Path(sys.executable).parent / "py-spy"  # the venv's, when the venv is not on PATH
    found = str(beside) if beside.is_file() else shutil.which("py-spy")
    if found is None:
        raise SystemExit("py-spy is not installed (pip install py-spy; it is in the dev extra)")
    return found


def record(py_spy: str, pids: dict[str, int], args: argparse.Namespace, out: Path) -> None:
    """Runs py-spy record on each role at once for --seconds, then prints each profile's summary."""
    recorders = []
    for role in args.roles:
        raw = out / f"{role}.txt"
        command = [py_spy, "record", "--pid", str(pids[role]), "--duration", str(args.seconds), "--rate",
                   str(args.rate), "--format", "raw", "--output", str(raw),
                   *(["--native"] if args.native else ["--nonblocking"]), *(["--gil"] if args.gil else [])]
        recorders.append((role, raw, subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)))
    for role, raw, recorder in recorders:
        _, error = recorder.communicate()
        if recorder.returncode != 0:
            print(f"py-spy on {role} failed ({recorder.returncode}): {error.decode(errors='replace')[-400:]}")
            continue
        print(f"\n## {role} (pid {pids[role]}, concurrency {args.concurrency})\n{summarise(raw, args.top)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--roles", nargs="+", default=["decode"], choices=["decode", "prefill", "gateway"])
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seconds", type=int, default=20)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prefill-batch-tokens", type=int, default=2048, help="the prefill worker's --batch-tokens")
    parser.add_argument("--prefill-batch-target-ms", type=float, default=DEFAULT_BATCH_TARGET_MS,
                        help="the prefill worker's --batch-target-ms (0: batches of --batch-tokens)")
    parser.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--log-level", default="WARNING", help="the services' log level (INFO: per-request lines)")
    parser.add_argument("--native", action="store_true", help="include native (C/C++) frames")
    parser.add_argument("--gil", action="store_true", help="only samples of the thread holding the GIL")
    parser.add_argument("--out", type=Path, default=None, help="where the profiles go (default: a temporary folder)")
    args = parser.parse_args()
    py_spy = find_py_spy()
    out = args.out or Path(tempfile.mkdtemp(prefix="profile-services-"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"machine: {machine_description()}\nprofiles in {out}", flush=True)
    spec = ClusterSpec(model_dir=str(args.model), listen="127.0.0.1:0", attention_backend="torch", transport="shm",
                       worker_args=("--num-threads", str(args.threads), "--kv-memory-mb", "512"),
                       prefill_args=("--batch-tokens", str(args.prefill_batch_tokens),
                                     "--batch-target-ms", str(args.prefill_batch_target_ms)),
                       log_level=args.log_level)
    cluster = Cluster(spec, log_dir=out)
    address = cluster.start(timeout_s=300)
    try:
        config = load_config(str(args.model))  # either family (DeepSeek-V3 or Kimi K3 / Linear)
        prompts, _ = make_prompts(args.model, max(2 * args.concurrency, 4), args.input_len, 0, config.vocab_size,
                                  list(config.eos_token_id))
        stop, result = threading.Event(), {"tokens": 0}
        driver = threading.Thread(target=lambda: result.update(tokens=asyncio.run(
            drive(address, prompts, args.output_len, args.concurrency, stop))))
        pids = {child.role.split("-")[0]: child.process.pid for child in cluster.children}
        names = {role: python_thread_names(py_spy, pid) for role, pid in pids.items()}
        cpu_before = {role: thread_cpu(pid, names[role]) for role, pid in pids.items()}
        metrics_addresses = cluster.metrics_addresses()
        metrics_address = metrics_addresses["decode-0"]
        steps_before = scrape(metrics_address, STEP_COUNTERS)
        phases_before = scrape_phases(metrics_addresses)
        started = time.perf_counter()
        driver.start()
        record(py_spy, pids, args, out)
        stop.set()
        driver.join()
        elapsed = time.perf_counter() - started
        print(f"\nload: {result['tokens']} tokens in {elapsed:.1f} s, {result['tokens'] / elapsed:.1f} tok/s "
              f"(whole waves of requests; load average {os.getloadavg()[0]:.1f} at the end)")
        steps = {name: value - steps_before.get(name, 0.0) for name, value in scrape(metrics_address, STEP_COUNTERS).items()}
        count, tokens = steps.get(STEP_COUNTERS[0], 0.0), steps.get(STEP_COUNTERS[1], 0.0)
        print(f"\ndecode engine: {count:.0f} steps, {tokens / max(count, 1):.2f} tokens per step (batch occupancy)")
        print(f"\n{phase_table(phases_before, scrape_phases(metrics_addresses))}")
        for role, pid in pids.items():
            print(f"\n## {role}: {thread_table(cpu_before[role], thread_cpu(pid, names[role]), result['tokens'])}")
    finally:
        cluster.stop()


if __name__ == "__main__":
    main()
