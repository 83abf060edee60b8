"""`pdserve generate "text"`: stream one completion from a running gateway to stdout."""
from __future__ import annotations

import argparse
import asyncio
import sys
import time

from pdserve.commands.common import DEFAULT_GATEWAY, fail


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", nargs="?", default=None, help="prompt text (or use --token-ids)")
    parser.add_argument("--gateway", default=DEFAULT_GATEWAY, help=f"gateway address (default {DEFAULT_GATEWAY})")
    parser.add_argument("--token-ids", default=None, help="comma-separated prompt token ids instead of text")
    parser.add_argument("--max-tokens", type=int, default=None, help="tokens to generate (default: the server's)")
    parser.add_argument("--temperature", type=float, default=None, help="0 = greedy (default: the model's)")
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    parser.add_argument("--no-spec", action="store_true", help="disable speculative decoding for this request")
    parser.add_argument("--block-size", type=int, default=None, help="speculative block size")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before giving up (the request deadline)")
    parser.add_argument("--quiet", action="store_true", help="no statistics line on stderr")


async def _main(args: argparse.Namespace) -> int:
    import grpc

    from gateway.client import build_request
    from rpc.convert import finish_reason_name
    from rpc.v1 import gateway_pb2, gateway_pb2_grpc

    prompt: str | list[int]
    if args.token_ids:
        try:
            prompt = [int(part) for part in args.token_ids.split(",") if part.strip()]
        except ValueError:
            return fail("generate", "--token-ids must be comma-separated integers")
    elif args.prompt is not None:
        prompt = args.prompt
    else:
        return fail("generate", "give a prompt or --token-ids")
    request = build_request(prompt, max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos,
                            speculative=False if args.no_spec else None, block_size=args.block_size)
    start = time.perf_counter()
    tokens = 0
    async with grpc.aio.insecure_channel(args.gateway) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        try:
            async for response in stub.Generate(request, timeout=args.timeout):
                kind = response.WhichOneof("kind")
                if kind == "chunk":
                    tokens += len(response.chunk.token_ids)
                    sys.stdout.write(response.chunk.text)
                    sys.stdout.flush()
                elif kind == "complete" and not args.quiet:
                    done = response.complete
                    elapsed = time.perf_counter() - start
                    sys.stdout.write("\n")
                    sys.stderr.write(
                        f"[{finish_reason_name(done.finish_reason).lower()}] {tokens} tokens in "
                        f"{elapsed:.2f} s ({tokens / max(elapsed, 1e-9):.1f} tok/s), TTFT {done.ttft_ms:.1f} ms, "
                        f"{done.acceptance.mean_accepted_tokens:.2f} tokens/step\n")
                elif kind == "complete":
                    sys.stdout.write("\n")
        except grpc.aio.AioRpcError as error:
            sys.stdout.write("\n" if tokens else "")
            return fail("generate", f"{error.code().name}: {error.details()}", 1)
    return 0


def run(args: argparse.Namespace) -> int:
    return asyncio.run(_main(args))
