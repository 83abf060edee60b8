"""`pdserve up`: launch decode, prefill and gateway processes on this machine and keep them running
(a process that dies is restarted, within a restart budget) until Ctrl-C / SIGTERM (then stop all of
them: no orphan process, nothing left in /dev/shm)."""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

from pdserve.commands.common import (
    DEFAULT_GATEWAY, DEFAULT_HTTP, DEFAULT_MODEL_DIR, add_cache_routing_arguments, add_device_arguments,
    add_prefix_cache_argument, cache_routing_flags, device_flags, device_kwargs, fail,
)
from rpc.logging_setup import configure_logging

logger = logging.getLogger("pdserve.up")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL_DIR, help="model directory (default: the embedded K3-shaped pdserve-k3-tiny)")
    parser.add_argument("--num-prefill", type=int, default=1, help="prefill workers")
    parser.add_argument("--num-decode", type=int, default=1, help="decode workers")
    parser.add_argument("--prefill-tp", type=int, default=1, help="tensor-parallel ranks per prefill worker")
    parser.add_argument("--decode-tp", type=int, default=1, help="tensor-parallel ranks per decode worker")
    parser.add_argument("--listen", default=DEFAULT_GATEWAY, help=f"gateway address (default {DEFAULT_GATEWAY})")
    parser.add_argument("--http-listen", default=DEFAULT_HTTP,
                        help=f"gateway's OpenAI-compatible HTTP API and /metrics (default {DEFAULT_HTTP}; '' for none)")
    parser.add_argument("--attention-backend", default="auto", help="auto | torch | triton | aiter")
    parser.add_argument("--transport", choices=("auto", "shm", "grpc", "device"), default="auto",
                        help="KV handoff between the workers: auto (per request: device with a GPU decode pool, else shm "
                             "on one host, grpc across hosts), or force shm / device (pool exported over CUDA/HIP IPC; "
                             "on the CPU a memfd stand-in) / grpc")
    parser.add_argument("--draft-model", default=None, help="draft directory ('' disables speculative decoding)")
    parser.add_argument("--kv-memory-mb", type=int, default=None, help="KV pool per decode rank (MiB)")
    parser.add_argument("--num-threads", type=int, default=None, help="torch threads per worker rank")
    parser.add_argument("--cpu-split", action=argparse.BooleanOptionalAction, default=True,
                        help="on the CPU: prefill workers on the lower half of the cores, decode workers on the upper "
                             "half, torch threads = cores (as separate GPUs would keep them apart; default on)")
    parser.add_argument("--core-lending", action=argparse.BooleanOptionalAction, default=True,
                        help="with the prefill and decode workers on separate CPUs, the decode workers (TP 1) also "
                             "run their steps on the prefill workers' CPUs while none of them computes (one decode "
                             "worker: a thread per lent CPU); a prefill forward takes them back first (default on; "
                             "rpc/core_board.py)")
    parser.add_argument("--prefill-borrowing", action=argparse.BooleanOptionalAction, default=True,
                        help="with core lending and prefill TP 1, the other way too: a prefill worker runs its steps "
                             "on the decode workers' CPUs while none of them has requests to step (steps of at most "
                             "512 prompt tokens; a decode worker that gets work waits for the step in flight; "
                             "default on)")
    parser.add_argument("--prefill-cpus", default=None, metavar="LIST", help="pin the prefill workers to these CPUs (e.g. 0-3)")
    parser.add_argument("--decode-cpus", default=None, metavar="LIST", help="pin the decode workers to these CPUs")
    add_prefix_cache_argument(parser)
    add_cache_routing_arguments(parser)
    parser.add_argument("--internal", choices=("uds", "tcp"), default="uds",
                        help="how the workers listen: Unix sockets in a private 0700 directory (default), or TCP on "
                             "127.0.0.1 with a generated token every internal call must carry")
    parser.add_argument("--tls-cert", default=None, help="the gateway's PEM certificate chain (serve TLS, with --tls-key)")
    parser.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    parser.add_argument("--api-key-file", default=None, help="API keys clients must send to the gateway, one per line")
    parser.add_argument("--max-restarts", type=int, default=5,
                        help="restarts allowed per process within --restart-window before giving up (default 5)")
    parser.add_argument("--restart-window", type=float, default=600.0, help="seconds (default 600)")
    parser.add_argument("--hang-restart-after", type=float, default=60.0, metavar="SECONDS",
                        help="kill and restart a worker whose health probe (every 5 s) has not answered SERVING for "
                             "this long: hung, not dead (default 60; 0: never)")
    add_device_arguments(parser)
    parser.add_argument("--no-shared-weights", dest="share_weights", action="store_false",
                        help="every worker rank loads a private copy of the weights (default: one copy per node)")
    parser.add_argument("--start-timeout", type=float, default=600.0, help="seconds to wait for everything to be healthy")
    parser.add_argument("--disagg-threshold-tokens", type=int, default=None, metavar="N",
                        help="the gateway's --disagg-threshold-tokens: prompts whose part the decode worker lacks is "
                             "shorter than N are prefilled by the decode worker itself (0: always a prefill worker; "
                             "default: the gateway's)")
    parser.add_argument("--local-prefill-tokens-per-step", type=int, default=None, metavar="N",
                        help="the decode workers' --local-prefill-tokens-per-step: while requests decode, a step "
                             "prefilling a prompt locally takes at most N tokens (default: the decode worker's)")
    parser.add_argument("--no-mixed-steps", dest="mixed_steps", action="store_false",
                        help="the decode workers' --no-mixed-steps: local prefill steps alternate with decode steps "
                             "instead of joining them")


def _check_device(args: argparse.Namespace) -> None:
    """--device / --gpus errors before any process starts (e.g. cuda without a GPU, more ranks than GPUs, a
    transport a GPU decode pool cannot serve)."""
    from engine.runtime.devices import check_gpus, gpu_count, resolve_device

    options = device_kwargs(args)
    if args.device == "cuda" and resolve_device(args.device) == "cuda":
        for tp in {args.prefill_tp, args.decode_tp}:
            check_gpus(tp, options["gpus"], gpu_count())
        if args.transport == "shm":
            raise ValueError("--transport shm with --device cuda: the decode pool lives on the GPU (exported over "
                             "IPC); use --transport auto, device or grpc")


def cpu_pinning(args: argparse.Namespace) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(prefill worker flags, decode worker flags): --cpus for each role on a CPU deployment (--prefill-cpus /
    --decode-cpus, else with --cpu-split the halves of the cores this process may use); none on CUDA or with
    fewer than 2 cores. ValueError for a bad list."""
    from pdserve.cpu_split import format_cpu_list, parse_cpu_list, split_cpus

    explicit = {role: getattr(args, f"{role}_cpus") for role in ("prefill", "decode")}
    for text in explicit.values():
        if text is not None:
            parse_cpu_list(text)
    if args.device == "cuda":
        if any(text is not None for text in explicit.values()):
            raise ValueError("--prefill-cpus / --decode-cpus apply to CPU workers, not --device cuda")
        return (), ()
    halves = split_cpus(tuple(os.sched_getaffinity(0))) if args.cpu_split else None
    flags: list[tuple[str, ...]] = []
    for index, role in enumerate(("prefill", "decode")):
        text = explicit[role] if explicit[role] is not None else (format_cpu_list(halves[index]) if halves else None)
        flags.append(("--cpus", text) if text else ())
    return flags[0], flags[1]


def run(args: argparse.Namespace) -> int:
    configure_logging("up", 0, args.log_level)
    from gateway.router import CacheWeights
    from pdserve.launcher import Cluster, ClusterSpec
    from pdserve.hang_watch import HangPolicy, HangWatch
    from pdserve.supervisor import GaveUp, RestartPolicy, Supervisor

    if args.device != "auto" or args.gpus:  # auto: the workers run on CPU (serving_device); no torch import here
        try:
            _check_device(args)
        except ValueError as error:
            return fail("up", error)
    worker_args: tuple[str, ...] = device_flags(args) if args.device != "auto" or args.gpus or args.no_graphs else ()
    if args.num_threads is not None:
        worker_args += ("--num-threads", str(args.num_threads))
    if not args.share_weights:
        worker_args += ("--no-shared-weights",)
    if not args.prefix_cache:
        worker_args += ("--no-prefix-cache",)
    decode_args = ("--kv-memory-mb", str(args.kv_memory_mb)) if args.kv_memory_mb else ()
    if args.local_prefill_tokens_per_step is not None:
        decode_args += ("--local-prefill-tokens-per-step", str(args.local_prefill_tokens_per_step))
    if not args.mixed_steps:
        decode_args += ("--no-mixed-steps",)
    try:
        prefill_pins, decode_pins = cpu_pinning(args)
        CacheWeights(args.cache_routing_weight, args.cache_routing_max_load)  # refused here, before any process starts
        decode_args += decode_pins
        lend_cpus = (prefill_pins[1] if args.core_lending and prefill_pins and decode_pins and args.decode_tp == 1
                     else None)
        lend_back_cpus = decode_pins[1] if lend_cpus and args.prefill_borrowing and args.prefill_tp == 1 else None
        spec = ClusterSpec(model_dir=args.model, num_prefill=args.num_prefill, num_decode=args.num_decode,
                           prefill_tp=args.prefill_tp, decode_tp=args.decode_tp, listen=args.listen, http_listen=args.http_listen,
                           attention_backend=args.attention_backend, transport=args.transport,
                           draft_model=args.draft_model, worker_args=worker_args, decode_args=decode_args, prefill_args=prefill_pins,
                           log_level=args.log_level, internal=args.internal, tls_cert=args.tls_cert,
                           tls_key=args.tls_key, api_key_file=args.api_key_file, lend_cpus=lend_cpus,
                           lend_back_cpus=lend_back_cpus,
                           gateway_args=cache_routing_flags(args) + (() if args.disagg_threshold_tokens is None else
                           ("--disagg-threshold-tokens", str(args.disagg_threshold_tokens))))
    except ValueError as error:
        return fail("up", error)
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    cluster = Cluster(spec)
    try:
        address = cluster.start(args.start_timeout, interrupt=stop)
    except InterruptedError:
        return 130
    except (RuntimeError, TimeoutError) as error:
        return fail("up", error, 1)
    sys.stdout.write(
        f"pdserve is up: gateway {address} ({spec.num_prefill} prefill x TP{spec.prefill_tp}, "
        f"{spec.num_decode} decode x TP{spec.decode_tp}, {spec.transport} transport, model {spec.model_dir})\n"
        f"prefill workers: {' '.join(c.address for c in cluster.children if c.role.startswith('prefill'))}\n"
        f"decode workers:  {' '.join(c.address for c in cluster.children if c.role.startswith('decode'))}\n"
        + (f"http (OpenAI API): http://{cluster.http_address}/v1\n" if cluster.http_address else "")
        + (f"cpus: prefill {prefill_pins[1] if prefill_pins else 'all'}, decode {decode_pins[1] if decode_pins else 'all'}\n")
        + "metrics: " + " ".join(f"{role}=http://{where}/metrics" for role, where in cluster.metrics_addresses().items())
        + f"\ntry:  pdserve generate --gateway {address} \"def fibonacci(n):\" --max-tokens 64\n"
        "Ctrl-C stops everything.\n")
    sys.stdout.flush()
    code = 0
    supervisor = Supervisor(cluster, RestartPolicy(max_restarts=args.max_restarts, window_s=args.restart_window),
                            hang_watch=HangWatch(HangPolicy(limit_s=args.hang_restart_after)))
    try:
        while not stop.wait(0.5):
            supervisor.check()  # restarts what died, with backoff, within the restart budget
    except GaveUp as error:
        logger.error("%s; stopping everything", error)
        code = 1
    finally:
        logger.info("stopping all services")
        cluster.stop()
        logger.info("all services stopped")
    return code
