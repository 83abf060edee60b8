"""`pdserve bench`: load-test a running gateway through its gRPC API or its OpenAI-compatible HTTP API
(--backend openai) (see docs/bench.md)."""
from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import NoReturn

from bench.config import BenchConfig, SamplingOptions, parse_sweep
from bench.prefix_workloads import WORKLOADS, ConversationShape, SharedPrefixShape
from bench.slo import SLO
from bench.workload import WorkloadError
from pdserve.commands.common import DEFAULT_GATEWAY

PROG = "pdserve bench"


def _fail(message: object, code: int) -> int:
    """One line on stderr, no traceback."""
    text = " ".join(str(message).split())
    sys.stderr.write(f"{PROG}: error: {text}\n")
    sys.stderr.flush()
    return code


def _argument_type(parse, what: str):
    """Wraps a parser so argparse shows its message (argparse hides a plain ValueError's text)."""

    def convert(text: str):
        try:
            return parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(f"{what}: {error}") from None

    return convert


def _make_errors_one_line(parser: argparse.ArgumentParser) -> None:
    """argparse prints the usage block before an error and leaves unknown options to the top-level
    parser; here both become one line on stderr and exit code 2."""
    parse_known_args = parser.parse_known_args

    def one_line_error(message: str) -> NoReturn:
        sys.exit(_fail(message, 2))

    def parse_known_args_strict(args=None, namespace=None):
        namespace, extras = parse_known_args(args, namespace)
        if extras:
            one_line_error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras

    parser.error = one_line_error
    parser.parse_known_args = parse_known_args_strict


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _make_errors_one_line(parser)
    target = parser.add_argument_group("target")
    target.add_argument("--gateway", default=DEFAULT_GATEWAY, help=f"gateway host:port (default {DEFAULT_GATEWAY})")
    target.add_argument("--backend", choices=("pdserve", "openai"), default="pdserve",
                        help="pdserve: the gateway's gRPC API (default); openai: its OpenAI-compatible HTTP API")
    target.add_argument("--base-url", default="http://127.0.0.1:8000/v1",
                        help="the OpenAI API's base URL for --backend openai (default http://127.0.0.1:8000/v1)")
    target.add_argument("--connect-timeout", type=float, default=10.0, help="seconds to wait for the gateway")
    target.add_argument("--request-timeout", type=float, default=None, help="per-request deadline in seconds")
    work = parser.add_argument_group("workload")
    work.add_argument("--workload", choices=WORKLOADS, default="random",
                      help="random: --input-len prompts (or --dataset); shared-prefix: --num-prefixes prefixes of "
                           "--prefix-min-len..--prefix-len tokens + --suffix-len suffixes; multi-turn: --conversations "
                           "chats of --turns turns, each resending the history + a new --input-len message")
    work.add_argument("--dataset", type=Path, default=None,
                      help='JSONL prompt file, one {"prompt": text, "output_len": n} per line (default: random)')
    work.add_argument("--num-prompts", type=int, default=1000, help="requests per run (default 1000)")
    work.add_argument("--input-len", type=int, default=1024, help="random prompt length in tokens (default 1024)")
    work.add_argument("--output-len", type=int, default=400, help="tokens to generate (default 400)")
    work.add_argument("--range-ratio", type=float, default=1.0,
                      help="lengths uniform in [len * ratio, len] (default 1.0: fixed)")
    work.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=None,
                      help="generate exactly --output-len tokens (default: on for random, off for --dataset)")
    work.add_argument("--seed", type=int, default=0, help="seed of prompts and arrivals (default 0)")
    prefix = parser.add_argument_group("shared-prefix and multi-turn workloads")
    shared, chat = SharedPrefixShape(), ConversationShape()
    for flag, kind, default, text in (
        ("--num-prefixes", int, shared.num_prefixes, "shared-prefix: prefixes, taken round robin"),
        ("--prefix-len", int, shared.prefix_len, "shared-prefix: longest prefix in tokens"),
        ("--prefix-min-len", int, shared.prefix_min_len, "shared-prefix: shortest prefix in tokens"),
        ("--suffix-len", int, shared.suffix_len, "shared-prefix: suffix length (lengths as --range-ratio)"),
        ("--conversations", int, chat.conversations, "multi-turn: conversations, all interleaved"),
        ("--turns", int, chat.turns, "multi-turn: turns per conversation"),
        ("--think-time", float, chat.think_time_s, "multi-turn: seconds between an answer and the next turn"),
        ("--system-prompt-len", int, chat.system_len, "multi-turn: tokens of each conversation's system prompt"),
    ):
        prefix.add_argument(flag, type=kind, default=default, help=f"{text} (default {default})")
    load = parser.add_argument_group("load")
    fixed = load.add_mutually_exclusive_group()
    fixed.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    fixed.add_argument("--concurrency-sweep", type=_argument_type(parse_sweep, "--concurrency-sweep"),
                       default=None, help="one run per concurrency, e.g. 1,4,16,64")
    load.add_argument("--request-rate", type=float, default=float("inf"),
                      help="requests/s, Poisson arrivals (default inf: all at once)")
    load.add_argument("--burstiness", type=float, default=1.0,
                      help="gamma shape of inter-arrival times: 1 Poisson, <1 burstier (default 1)")
    load.add_argument("--warmup-requests", type=int, default=1, help="unmeasured requests first (default 1)")
    sampling = parser.add_argument_group("sampling")
    sampling.add_argument("--temperature", type=float, default=0.0, help="default 0 (greedy)")
    sampling.add_argument("--top-p", type=float, default=None)
    sampling.add_argument("--top-k", type=int, default=None)
    sampling.add_argument("--speculative", action=argparse.BooleanOptionalAction, default=None,
                          help="force speculative decoding on/off (default: the server's choice)")
    sampling.add_argument("--block-size", type=int, default=None, help="speculative block size")
    sampling.add_argument("--stream-interval", type=int, default=None,
                          help="tokens per streamed chunk (GenerateRequest.stream_interval; default: every step)")
    report = parser.add_argument_group("report")
    report.add_argument("--slo", type=_argument_type(SLO.parse, "--slo"), default=None,
                        help="goodput bounds, e.g. ttft_ms=500,tpot_ms=50,e2e_ms=20000")
    report.add_argument("--gpus", type=int, default=1, help="GPUs of the deployment (default 1)")
    report.add_argument("--gpu-price", type=float, default=None, help="$ per GPU-hour, e.g. 2.50")
    report.add_argument("--output-file", type=Path, default=None, help="append one JSON line per run")
    report.add_argument("--plot", type=Path, default=None, help="PNG of throughput and latency vs concurrency")
    report.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def config_from_args(args: argparse.Namespace) -> tuple[BenchConfig, SamplingOptions]:
    """Raises ValueError (one-line message) for values argparse could not check."""
    concurrencies = args.concurrency_sweep or (args.max_concurrency,)
    config = BenchConfig(
        gateway=args.gateway, backend=args.backend, base_url=args.base_url, num_prompts=args.num_prompts, input_len=args.input_len,
        output_len=args.output_len, range_ratio=args.range_ratio, dataset=args.dataset,
        ignore_eos=args.ignore_eos, seed=args.seed, concurrencies=concurrencies,
        request_rate=args.request_rate, burstiness=args.burstiness, warmup_requests=args.warmup_requests,
        slo=args.slo, gpus=args.gpus, gpu_price=args.gpu_price, output_file=args.output_file,
        plot=args.plot, connect_timeout_s=args.connect_timeout, progress=not args.no_progress,
        workload=args.workload,
        shared_prefix=SharedPrefixShape(args.num_prefixes, args.prefix_min_len, args.prefix_len, args.suffix_len),
        conversation=ConversationShape(args.conversations, args.turns, args.think_time, args.system_prompt_len),
    )
    grpc_only = (args.speculative, args.block_size, args.stream_interval)
    if args.backend == "openai" and any(value is not None for value in grpc_only):
        raise ValueError("--speculative / --block-size / --stream-interval are gRPC-only; the OpenAI API has no such "
                         "parameters")
    sampling = SamplingOptions(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, speculative=args.speculative,
        block_size=args.block_size, timeout_s=args.request_timeout, stream_interval=args.stream_interval,
    )
    return config, sampling


def run(args: argparse.Namespace) -> int:
    """0: every run completed at least one request; 1: a run completed none or warm-up failed;
    2: bad arguments, bad dataset, or no gateway at the address."""
    try:
        config, sampling = config_from_args(args)
    except ValueError as error:
        return _fail(error, 2)
    from bench.client import GatewayUnreachable  # grpc and the generated stubs: only when running
    from bench.runner import BenchError, run_benchmark

    try:
        results = asyncio.run(run_benchmark(config, sampling))
    except (GatewayUnreachable, WorkloadError) as error:
        return _fail(error, 2)
    except BenchError as error:
        return _fail(error, 1)
    except KeyboardInterrupt:
        return _fail("interrupted", 130)
    if not all(result["completed"] for result in results):
        return _fail("a run completed no request (see the warnings above)", 1)
    return 0
