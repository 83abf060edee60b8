"""`pdserve gateway`: run the public gateway in front of running prefill and decode workers."""
from __future__ import annotations

import argparse
from pathlib import Path

from gateway.config import DEFAULT_DISAGG_THRESHOLD_TOKENS, DEFAULT_STANDING_LEASE_TOKENS
from pdserve.commands.common import (DEFAULT_GATEWAY, DEFAULT_HTTP, add_cache_routing_arguments,
                                     add_internal_token_argument, add_model_arguments, fail)
from rpc.interceptors import read_key_file, read_token_file
from rpc.logging_setup import configure_logging


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--listen", default=DEFAULT_GATEWAY, help=f"host:port to serve on (default {DEFAULT_GATEWAY})")
    parser.add_argument("--http-listen", default=DEFAULT_HTTP, metavar="HOST:PORT",
                        help=f"OpenAI-compatible HTTP API, /health and /metrics (default {DEFAULT_HTTP}; '' for none)")
    parser.add_argument("--prefill", action="append", required=True, metavar="HOST:PORT", help="a prefill worker (repeat for more)")
    parser.add_argument("--decode", action="append", required=True, metavar="HOST:PORT", help="a decode worker (repeat for more)")
    add_model_arguments(parser)
    parser.add_argument("--transport", choices=("auto", "shm", "grpc", "device"), default="auto",
                        help="KV handoff: auto (per request, from where both workers are), shm (same host, CPU pool), "
                             "device (same host, device pool over CUDA/HIP IPC) or grpc (any host)")
    parser.add_argument("--default-max-tokens", type=int, default=256, help="max_tokens when a request leaves it unset")
    parser.add_argument("--admission-timeout", type=float, default=30.0,
                        help="seconds a request waits for decode room before RESOURCE_EXHAUSTED")
    parser.add_argument("--standing-lease-tokens", type=int, default=DEFAULT_STANDING_LEASE_TOKENS, metavar="N",
                        help="keep one spare decode reservation of N prompt tokens per decode worker (with room for "
                             "two), so that a request whose prompt fits skips the Reserve round trip before prefill; "
                             f"longer prompts Reserve as before (default {DEFAULT_STANDING_LEASE_TOKENS}; 0: off)")
    parser.add_argument("--disagg-threshold-tokens", type=int, default=DEFAULT_DISAGG_THRESHOLD_TOKENS, metavar="N",
                        help="a prompt whose part the chosen decode worker does not hold in its prefix cache (K3: past "
                             "its state checkpoint) is shorter than N tokens is prefilled by that decode worker itself, "
                             f"with no prefill hop (0: always a prefill worker; default {DEFAULT_DISAGG_THRESHOLD_TOKENS}, "
                             "measured: docs/services.md)")
    add_cache_routing_arguments(parser)
    parser.add_argument("--hang-probe-failures", type=int, default=2, metavar="N",
                        help="a decode worker whose load probe (every 0.2 s, 2 s timeout) fails N times in a row is "
                             "hung: its running requests fail UNAVAILABLE and it is not routed to until it answers "
                             "(default 2, about 4.5 s; 0: never)")
    parser.add_argument("--stream-silence", type=float, default=30.0, metavar="SECONDS",
                        help="a decode worker whose DecodeStream sends no engine step for this long while requests "
                             "run on it is hung too (default 30; 0: never)")
    parser.add_argument("--migration-limit", type=int, default=3, metavar="N",
                        help="a request whose decode worker dies or hangs mid-stream is admitted again on another one "
                             "(prefill of prompt + tokens streamed so far), at most N times (default 3; 0: off)")
    parser.add_argument("--max-request-bytes", type=int, default=4 * 2**20,
                        help="largest request (and prompt text) accepted, refused before tokenising (default 4 MiB)")
    parser.add_argument("--tls-cert", default=None, help="PEM certificate chain: serve TLS (with --tls-key)")
    parser.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    parser.add_argument("--api-key", action="append", default=[], help="a key clients must send as a bearer token (repeat for more)")
    parser.add_argument("--api-key-file", default=None, help="file of API keys, one per line")
    add_internal_token_argument(parser)
    parser.add_argument("--ready-file", default=None, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    configure_logging("gateway", 0, args.log_level)
    from gateway.config import GatewayConfig
    from gateway.liveness import LivenessConfig
    from gateway.migration import MigrationConfig
    from gateway.server import serve
    from rpc.server import run as run_event_loop

    if not Path(args.model, "config.json").is_file():
        return fail("gateway", f"model directory {args.model!r} has no config.json")
    try:
        config = GatewayConfig(model_dir=args.model, prefill=tuple(args.prefill), decode=tuple(args.decode),
                               listen=args.listen, http_listen=args.http_listen, transport=args.transport, default_max_tokens=args.default_max_tokens,
                               admission_timeout_s=args.admission_timeout, standing_lease_tokens=args.standing_lease_tokens,
                               disagg_threshold_tokens=args.disagg_threshold_tokens,
                               cache_routing_weight=args.cache_routing_weight,
                               cache_routing_max_load=args.cache_routing_max_load,
                               liveness=LivenessConfig(args.hang_probe_failures, args.stream_silence),
                               migration=MigrationConfig(args.migration_limit),
                               max_request_bytes=args.max_request_bytes, tls_cert=args.tls_cert, tls_key=args.tls_key,
                               api_keys=tuple(args.api_key) + (read_key_file(args.api_key_file) if args.api_key_file else ()),
                               internal_token=read_token_file(args.internal_token_file))
    except (ValueError, OSError) as error:
        return fail("gateway", error)
    run_event_loop(lambda: serve(config, ready_file=args.ready_file))
    return 0
