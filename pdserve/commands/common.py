"""Flags and helpers shared by the service commands (gateway, prefill, decode, up)."""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Awaitable, Callable
from typing import Any

from engine.paths import DEFAULT_MODEL_DIR as ENGINE_DEFAULT_MODEL_DIR
from rpc.interceptors import read_token_file

DEFAULT_MODEL_DIR = str(ENGINE_DEFAULT_MODEL_DIR)
DEFAULT_GATEWAY = "127.0.0.1:50051"
DEFAULT_HTTP = "127.0.0.1:8000"


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL_DIR, help="model directory (default: the embedded K3-shaped pdserve-k3-tiny)")


def add_engine_arguments(parser: argparse.ArgumentParser, default_memory_mb: int) -> None:
    """The engine flags of a worker (prefill and decode take the same ones)."""
    add_model_arguments(parser)
    parser.add_argument("--tp-size", type=int, default=1, help="tensor-parallel ranks (processes) of this worker")
    parser.add_argument("--attention-backend", default="auto", help="auto | torch | triton | aiter")
    parser.add_argument("--draft-model", default=None,
                        help="draft model directory (default: the model's draft/ folder if present; '' disables)")
    parser.add_argument("--dtype", default="auto", help="auto (bfloat16 on GPUs, float32 on CPU) | float32 | bfloat16 | float16")
    parser.add_argument("--draft-dtype", default="auto",
                        help="the draft model's dtype: auto (--dtype's) | float32 | bfloat16 | float16 (bfloat16 beside a "
                             "float32 target pays only on a CPU with native bf16, and not for every draft: BENCHMARKS.md)")
    add_device_arguments(parser)
    parser.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    parser.add_argument("--kv-memory-mb", type=int, default=default_memory_mb, help="KV pool size per rank (MiB)")
    parser.add_argument("--max-batched-tokens", type=int, default=2048, help="prefill chunk size (tokens per forward)")
    parser.add_argument("--spec-block-size", type=int, default=8, help="largest speculative block size")
    parser.add_argument("--spec-min-tokens-per-step", type=float, default=0.0,
                        help="a request whose verify steps emit fewer tokens than this (moving average) decodes "
                             "plainly for a while, then probes again; ~2 pays on CPU (default 0: always speculate)")
    parser.add_argument("--num-threads", type=int, default=None, help="torch threads per rank")
    parser.add_argument("--cpus", default=None, metavar="LIST",
                        help="pin this worker (engine process and TP followers included) to these CPUs, e.g. 0-3,6, "
                             "or prefill-half / decode-half (the half of this process's CPUs `pdserve up` gives that "
                             "role; no pinning with fewer than 2); torch threads then default to their count "
                             "(`pdserve up` sets it on a CPU node)")
    add_prefix_cache_argument(parser)
    parser.add_argument("--metrics-listen", default="", metavar="HOST:PORT",
                        help="serve Prometheus GET /metrics here (port 0: any free port; default: none)")
    parser.add_argument("--no-shared-weights", dest="share_weights", action="store_false",
                        help="load a private copy of the weights instead of mapping the node's shared copy")
    parser.add_argument("--ready-file", default=None, help=argparse.SUPPRESS)  # written with the bound address
    add_internal_token_argument(parser)


def add_core_board_arguments(parser: argparse.ArgumentParser, role: str) -> None:
    """--core-board / --core-board-slot of both workers (core lending, rpc/core_board.py); role: what this worker
    does with the board, for the help text."""
    parser.add_argument("--core-board", default=None, metavar="PATH",
                        help=f"core lending on a CPU node (`pdserve up` sets it): the board file; {role}")
    parser.add_argument("--core-board-slot", type=int, default=0, metavar="N", help="this worker's byte on the board")


def add_borrow_arguments(parser: argparse.ArgumentParser, cpus: str) -> None:
    """--borrow-cpus / --borrow-threads of both workers (core lending); cpus: whose CPUs, and when they are used."""
    parser.add_argument("--borrow-cpus", default=None, metavar="LIST", help=cpus)
    parser.add_argument("--borrow-threads", type=int, default=None, metavar="N",
                        help="torch threads added while borrowing (default: one per --borrow-cpus core; 0: only the "
                             "wider CPU mask, for workers that share their own cores)")


def borrow_cpus(text: str | None) -> tuple[int, ...]:
    """--borrow-cpus (a list, or prefill-half / decode-half: see --cpus): checked against the CPUs this process may
    use (before --cpus narrows them); () for a half of fewer than 2 CPUs."""
    if text is None:
        return ()
    from pdserve.cpu_split import format_cpu_list, resolve_cpus

    cpus = resolve_cpus(text, tuple(sorted(os.sched_getaffinity(0))))
    outside = [cpu for cpu in cpus if cpu not in os.sched_getaffinity(0)]
    if outside:
        raise ValueError(f"--borrow-cpus {text}: CPU(s) {format_cpu_list(tuple(outside))} not available to this process")
    return cpus


def board_for(path: str | None, borrow_text: str | None, borrow: tuple[int, ...]) -> str | None:
    """--core-board for this worker: None when --borrow-cpus named a half of fewer than 2 CPUs (nothing to split,
    so no lending); otherwise the path, the board created there if missing (rpc.core_board.ensure_board)."""
    from pdserve.cpu_split import HALVES
    from rpc.core_board import ensure_board

    if path is None or (not borrow and borrow_text in HALVES):
        return None
    ensure_board(path)
    return path


def add_prefix_cache_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                        help="recompute every prompt from its first token (default: reuse cached pages and, for KDA "
                             "models, state checkpoints across requests)")


def add_cache_routing_arguments(parser: argparse.ArgumentParser) -> None:
    """The gateway's cache-aware routing (gateway/router.py; `pdserve gateway` and `pdserve up`)."""
    from gateway.config import DEFAULT_CACHE_ROUTING_WEIGHT

    parser.add_argument("--cache-routing-weight", type=float, default=DEFAULT_CACHE_ROUTING_WEIGHT, metavar="W",
                        help="route by cost = W x uncached prompt pages + load pages, lowest wins (the workers' prefix "
                             "caches as their KV events tell; docs/services.md); 0: by load only (default "
                             f"{DEFAULT_CACHE_ROUTING_WEIGHT})")
    parser.add_argument("--cache-routing-max-load", type=float, default=0.9, metavar="FRACTION",
                        help="a decode worker using more than this fraction of its pages is overloaded: its cache does "
                             "not count and it ranks after the others (default 0.9)")


def cache_routing_flags(args: argparse.Namespace) -> tuple[str, ...]:
    """The gateway's command-line flags for the cache routing arguments parsed here."""
    return ("--cache-routing-weight", str(args.cache_routing_weight),
            "--cache-routing-max-load", str(args.cache_routing_max_load))


def add_internal_token_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--internal-token-file", default=None,
                        help="file holding the token internal calls must carry (TCP deployments; "
                             "`pdserve up` generates one); none: no token checked")


def add_device_arguments(parser: argparse.ArgumentParser) -> None:
    """--device / --gpus / --no-graphs (workers and `pdserve up`)."""
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                        help="auto (a GPU when one is visible) | cpu | cuda (NVIDIA or AMD ROCm)")
    parser.add_argument("--gpus", default=None, help="GPUs of the ranks, e.g. 0-7 or 0,2 (rank r uses the r-th listed)")
    parser.add_argument("--no-graphs", action="store_true", help="run decode eagerly (no CUDA graph capture)")


def device_kwargs(args: argparse.Namespace) -> dict[str, object]:
    """--device / --gpus / --no-graphs as worker config keywords (ValueError for a bad --gpus)."""
    from engine.runtime.devices import parse_gpu_list

    gpus = parse_gpu_list(args.gpus) if args.gpus else None
    return dict(device=args.device, gpus=gpus, use_graphs=not args.no_graphs)


def device_flags(args: argparse.Namespace) -> tuple[str, ...]:
    """The same flags again, for a child worker's command line."""
    flags: tuple[str, ...] = ("--device", args.device)
    if args.gpus:
        flags += ("--gpus", args.gpus)
    return flags + (("--no-graphs",) if args.no_graphs else ())


def engine_kwargs(args: argparse.Namespace) -> dict[str, object]:
    """The engine flags as keyword arguments of the worker configs (ValueError for a bad --gpus)."""
    return dict(**device_kwargs(args),
        model_dir=args.model, tp_size=args.tp_size, attention_backend=args.attention_backend,
        draft_model_dir=args.draft_model, dtype=args.dtype, draft_dtype=args.draft_dtype, page_size=args.page_size,
        kv_memory_bytes=args.kv_memory_mb * 2**20, max_batched_tokens=args.max_batched_tokens,
        spec_block_size=args.spec_block_size, spec_min_tokens_per_step=args.spec_min_tokens_per_step,
        num_threads=args.num_threads, share_weights=args.share_weights, prefix_cache=args.prefix_cache,
        internal_token=read_token_file(args.internal_token_file),
    )


def fail(prog: str, message: object, code: int = 2) -> int:
    """One line on stderr, no traceback; returns the exit code."""
    sys.stderr.write(f"pdserve {prog}: error: {' '.join(str(message).split())}\n")
    sys.stderr.flush()
    return code


def pin_worker(args: argparse.Namespace) -> None:
    """--cpus: pins this process's threads (before the engine starts any) and makes the torch threads default to
    the pinned cores' count. ValueError for a bad list."""
    if args.cpus is None:
        return
    from pdserve.cpu_split import pin_process, resolve_cpus

    cpus = resolve_cpus(args.cpus, tuple(sorted(os.sched_getaffinity(0))))
    if not cpus:  # a half of fewer than 2 CPUs: nothing to split
        return
    pin_process(cpus)
    if args.num_threads is None:
        args.num_threads = len(cpus)


def run_worker(role: str, args: argparse.Namespace, build_config: Callable[..., Any],
               serve: Callable[..., Awaitable[None]], **role_kwargs: Any) -> int:
    """The body of `pdserve prefill` / `pdserve decode`: build_config(listen=..., metrics_listen=...,
    <engine flags>, **role_kwargs) (a bad flag: one line on stderr, exit 2), then serve(config) until stopped."""
    from rpc.server import run as run_event_loop

    try:
        pin_worker(args)
        config = build_config(listen=args.listen, metrics_listen=args.metrics_listen, **role_kwargs,
                              **engine_kwargs(args))  # device checks too
    except (ValueError, OSError) as error:
        return fail(role, error)
    run_event_loop(lambda: serve(config, ready_file=args.ready_file))
    return 0
