"""Through the containers vs `pdserve up` on the same machine (issue 19), in one run.

Brings up the compose cpu profile (scripts/compose.sh up: Docker Engine, or podman + docker-compose v1) and
`pdserve up` (1 prefill + 1 decode worker, TP 1, models/pdserve-tiny and its draft - the model the profile
serves, not up's K3 default - with up's defaults otherwise; each gateway's HTTP port is a free one), then
runs the same `pdserve bench` workload (random prompts, fixed input and output lengths, greedy, ignore eos,
closed loop at --max-concurrency) from the host against each gateway, taking turns, --repeats times after
one unrecorded warm-up each. Reports medians (min-max) of output tok/s and TTFT p50, the ratio (goal: containers >= 90% of `pdserve up`), and the load average.
Both setups stay up for the whole run but only one is loaded at a time. Everything started is stopped.

Run: .venv/bin/python -m benchmarks.bench_compose [--repeats 5] [--num-prompts 16] [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.common import Table, goal_line, interleave, machine_description, median, ratio

ROOT = Path(__file__).resolve().parents[1]
UP_LINE = re.compile(r"pdserve is up: gateway (\S+)")
COMPOSE_MODEL = ROOT / "models" / "pdserve-tiny"  # what the compose cpu profile serves (with its draft)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_pdserve_up(log_path: Path, timeout: float = 900.0) -> tuple[subprocess.Popen[str], str]:
    """`pdserve up` on a free loopback port; returns the process and the gateway address from its banner."""
    process = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "up", "--model", str(COMPOSE_MODEL),
                                "--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0"], cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: queue.Queue[str] = queue.Queue()
    log = log_path.open("w")

    def pump() -> None:
        for line in process.stdout:
            log.write(line)
            log.flush()
            lines.put(line)

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            match = UP_LINE.search(lines.get(timeout=1.0))
        except queue.Empty:
            if process.poll() is not None:
                raise RuntimeError(f"pdserve up exited with {process.returncode}; see {log_path}") from None
            continue
        if match:
            return process, match.group(1)
    process.send_signal(signal.SIGINT)
    raise RuntimeError(f"pdserve up was not up within {timeout} s; see {log_path}")


def bench_once(address: str, args: argparse.Namespace, output: Path) -> dict[str, float]:
    """One `pdserve bench` run (its own process, like an operator's) against address; its JSONL record."""
    command = [sys.executable, "-m", "pdserve.cli", "bench", "--gateway", address, "--connect-timeout", "300",
               "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.max_concurrency),
               "--input-len", str(args.input_len), "--output-len", str(args.output_len), "--no-progress",
               "--output-file", str(output)]
    subprocess.run(command, cwd=ROOT, check=True, capture_output=True, timeout=1800)
    record = json.loads(output.read_text().splitlines()[-1])
    if record["completed"] != args.num_prompts or record["failed"]:
        raise RuntimeError(f"{address}: {record['completed']} completed, {record['failed']} failed")
    return {"tok_s": record["output_throughput"], "ttft_ms": record["median_ttft_ms"],
            "tpot_ms": record["median_tpot_ms"]}


def spread(samples: list[dict[str, float]], key: str) -> str:
    values = [sample[key] for sample in samples]
    return f"{median(samples, key):.1f} ({min(values):.1f}-{max(values):.1f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="interleaved runs of each setup")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-concurrency", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="2 repeats of 4 prompts (smoke check)")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.num_prompts, args.max_concurrency = 2, 4, 2
    work = Path(tempfile.mkdtemp(prefix="bench_compose-"))
    env = {**os.environ, "COMPOSE_PROJECT_NAME": "pdserve-bench", "GATEWAY_PORT": str(free_port()),
           "HTTP_PORT": str(free_port())}
    script = str(ROOT / "scripts" / "compose.sh")
    print("# containers (compose cpu profile) vs `pdserve up`, same machine, same workload\n")
    print(f"machine: {machine_description()}  ")
    print(f"workload: pdserve bench, {args.num_prompts} random prompts, {args.input_len} in / {args.output_len} out, "
          f"concurrency {args.max_concurrency}, greedy, client on the host  ")
    print(f"repeats: {args.repeats} interleaved after one warm-up each; load average before: {os.getloadavg()}\n",
          flush=True)
    up_process = None
    try:
        subprocess.run([script, "up"], env=env, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, timeout=3600)
        up_process, up_address = start_pdserve_up(work / "pdserve-up.log")
        compose_address = f"127.0.0.1:{env['GATEWAY_PORT']}"
        results = interleave({
            "containers": lambda: bench_once(compose_address, args, work / "containers.jsonl"),
            "pdserve up": lambda: bench_once(up_address, args, work / "up.jsonl"),
        }, args.repeats)
    finally:
        if up_process is not None:
            os.killpg(up_process.pid, signal.SIGINT)
            up_process.wait(timeout=120)
        subprocess.run([script, "down"], env=env, cwd=ROOT, stdout=subprocess.DEVNULL, timeout=600)
    table = Table("median (min-max) of the runs", ["", "containers", "pdserve up", "containers / pdserve up"])
    for key, name in (("tok_s", "output tok/s"), ("ttft_ms", "TTFT p50 ms"), ("tpot_ms", "TPOT p50 ms")):
        table.add(name, spread(results["containers"], key), spread(results["pdserve up"], key),
                  f"{ratio(median(results['containers'], key), median(results['pdserve up'], key)):.2f}")
    table.print()
    throughput = ratio(median(results["containers"], "tok_s"), median(results["pdserve up"], "tok_s"))
    print(goal_line("containers throughput vs pdserve up", 100 * throughput, 90, unit="%"))
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
