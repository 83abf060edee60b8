"""The `pdserve` command: one subcommand module per job under pdserve/commands/."""
from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from pdserve.process_groups import die_with_parent_if_asked

# name -> module under pdserve.commands; each module defines add_arguments(parser) and run(args) -> int
COMMANDS = {
    "up": "Launch gateway + prefill + decode workers on this machine",
    "generate": "Stream a completion from a running gateway",
    "bench": "Load-test a gateway through the public gRPC API",
    "plan": "Capacity planning: does a model fit a GPU node, and at what cost",
    "gateway": "Run the gateway service alone",
    "prefill": "Run a prefill worker alone",
    "decode": "Run a decode worker alone",
}


def _command_module(name: str):
    return importlib.import_module(f"pdserve.commands.{name}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode serving")
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in COMMANDS.items():
        try:
            module = _command_module(name)
        except ModuleNotFoundError as error:
            if error.name != f"pdserve.commands.{name}":
                raise
            continue
        command_parser = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(command_parser)
        command_parser.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    # numpy's OpenBLAS starts a worker thread per core at import; our processes compute with torch, and a
    # process with that idle thread could not fork its engine process / TP followers (child_start_method).
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    die_with_parent_if_asked()
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s [%(name)s] %(message)s",
    )
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
