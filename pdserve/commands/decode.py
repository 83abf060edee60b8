"""`pdserve decode`: run one decode worker (its page pool in shared memory; TP followers are child processes)."""
from __future__ import annotations

import argparse

from pdserve.commands.common import (add_borrow_arguments, add_core_board_arguments, add_engine_arguments, board_for,
                                     borrow_cpus, fail, run_worker)
from rpc.logging_setup import configure_logging


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--listen", default="127.0.0.1:50071", help="host:port to serve on (port 0: any free port)")
    add_engine_arguments(parser, default_memory_mb=512)
    parser.add_argument("--max-running", type=int, default=64, help="most requests decoding at once")
    parser.add_argument("--lease-ttl", type=float, default=60.0, help="seconds a reservation waits for its Decode call")
    parser.add_argument("--advertise", default=None, help="host:port prefill workers push KV to (grpc transport)")
    parser.add_argument("--kv-pool", choices=("auto", "shm", "device"), default="auto",
                        help="where the KV pages live: shm (CPU shared memory), device (device memory exported over "
                             "CUDA/HIP IPC; on the CPU a memfd stand-in) or auto (device on a GPU, else shm)")
    parser.add_argument("--local-prefill-tokens-per-step", type=int, default=None, metavar="N",
                        help="prompts this worker prefills itself (the gateway's --disagg-threshold-tokens): while "
                             "requests decode, an engine step prefills at most N tokens and alternates with decode "
                             "steps (0: prefill first, whole steps; default: decode_worker.config."
                             "DEFAULT_LOCAL_PREFILL_TOKENS_PER_STEP)")
    parser.add_argument("--no-mixed-steps", dest="mixed_steps", action="store_false",
                        help="local prefill steps alternate with decode steps (default: each bounded prefill chunk "
                             "joins a decode step, one forward for both)")
    add_core_board_arguments(parser, "the prefill workers mark their forwards there; with --borrow-cpus")
    add_borrow_arguments(parser, "the prefill workers' CPUs: each engine step runs on them too (with --borrow-threads "
                                 "more threads) while no prefill worker on --core-board computes")


def run(args: argparse.Namespace) -> int:
    configure_logging("decode", 0, args.log_level)
    from decode_worker.config import DecodeWorkerConfig
    from decode_worker.server import serve

    bound = {} if args.local_prefill_tokens_per_step is None else {
        "prefill_tokens_while_decoding": args.local_prefill_tokens_per_step}
    bound["mixed_steps"] = args.mixed_steps
    try:
        borrow = borrow_cpus(args.borrow_cpus)
        core_board = board_for(args.core_board, args.borrow_cpus, borrow)
    except (ValueError, OSError) as error:
        return fail("decode", error)
    return run_worker("decode", args, DecodeWorkerConfig.build, serve, max_running=args.max_running,
                      lease_ttl_s=args.lease_ttl, advertise_address=args.advertise, kv_pool=args.kv_pool,
                      core_board=core_board, borrow_cpus=borrow, core_board_slot=args.core_board_slot,
                      borrow_threads=args.borrow_threads, **bound)

