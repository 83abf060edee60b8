"""`pdserve prefill`: run one prefill worker (its TP follower ranks are child processes)."""
from __future__ import annotations

import argparse

from pdserve.commands.common import (add_borrow_arguments, add_core_board_arguments, add_engine_arguments, board_for,
                                     borrow_cpus, fail, run_worker)
from prefill_worker.batch_policy import DEFAULT_BATCH_TARGET_MS
from rpc.core_board import DEFAULT_BORROW_STEP_TOKENS
from rpc.logging_setup import configure_logging


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--listen", default="127.0.0.1:50061", help="host:port to serve on (port 0: any free port)")
    add_engine_arguments(parser, default_memory_mb=256)
    parser.add_argument("--batch-tokens", type=int, default=2048,
                        help="prompt tokens taken from the queue into one prefill step (at least one prompt)")
    parser.add_argument("--batch-target-ms", type=float, default=DEFAULT_BATCH_TARGET_MS,
                        help="take fewer prompt tokens when the measured prefill cost says --batch-tokens would "
                             "take longer than this (0: no time cap)")
    add_core_board_arguments(parser, "this worker marks each forward there, so that a decode worker borrowing its "
                                     "cores hands them back first")
    add_borrow_arguments(parser, "the decode workers' CPUs: each engine step runs on them too (with --borrow-threads "
                                 "more threads) while no decode worker on --core-board has requests to step")
    parser.add_argument("--borrow-step-tokens", type=int, default=DEFAULT_BORROW_STEP_TOKENS, metavar="N",
                        help="with --borrow-cpus, an engine step takes at most N prompt tokens (caps "
                             "--max-batched-tokens): a decode worker that gets work waits at most one such step for "
                             "its cores")


def run(args: argparse.Namespace) -> int:
    configure_logging("prefill", 0, args.log_level)
    from prefill_worker.config import PrefillWorkerConfig
    from prefill_worker.server import serve

    try:
        borrow = borrow_cpus(args.borrow_cpus)
        core_board = board_for(args.core_board, args.borrow_cpus, borrow)
    except (ValueError, OSError) as error:
        return fail("prefill", error)
    return run_worker("prefill", args, PrefillWorkerConfig.build, serve, batch_tokens=args.batch_tokens,
                      batch_target_ms=args.batch_target_ms, core_board=core_board,
                      core_board_slot=args.core_board_slot, borrow_cpus=borrow, borrow_threads=args.borrow_threads,
                      borrow_step_tokens=args.borrow_step_tokens)
