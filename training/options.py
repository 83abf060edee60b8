"""What the two default-model entry points (train_default_model, train_k3_default_model) share: the common
command-line options, what --tiny scales down besides the model (corpus, draft, evaluation), the run's
logging and threads, and the command line recorded in the metrics.
"""
from __future__ import annotations

import argparse
import logging
import shlex
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class DraftShape:
    """The draft's transformer layers (DFlashConfig fields; the DSpark backbone is a DFlashConfig)."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int

    def as_kwargs(self) -> dict[str, int]:
        return asdict(self)


@dataclass(frozen=True)
class Scale:
    """max_files: corpus files per split (None: all); eval_windows: held-out loss windows; accept_prompts:
    prompts of the speculative acceptance measurement."""

    max_files: int | None
    draft_shape: DraftShape
    eval_windows: int
    accept_prompts: int


FULL_SCALE = Scale(max_files=None, draft_shape=DraftShape(2, 8, 4, 24, 512), eval_windows=64, accept_prompts=24)
TINY_SCALE = Scale(max_files=12, draft_shape=DraftShape(1, 2, 1, 16, 64), eval_windows=2, accept_prompts=2)


def base_parser(description: str | None, default_out: Path, threads: int) -> argparse.ArgumentParser:
    """--out, --seed, --threads, --tiny, --target-steps, --draft-steps; the entry point adds its own."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=default_out)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=threads)
    parser.add_argument("--tiny", action="store_true", help="toy shapes and a few steps (smoke test)")
    parser.add_argument("--target-steps", type=int, default=None)
    parser.add_argument("--draft-steps", type=int, default=None)
    return parser


def start_run(args: argparse.Namespace) -> Scale:
    """Logging to stderr, torch's intra-op threads; returns the run's scale."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s [training] %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    return TINY_SCALE if args.tiny else FULL_SCALE


def command_line(prefix: str, module: str, argv: list[str] | None) -> str:
    """The command that reproduces this run, as recorded in training_metrics.json."""
    return f"{prefix}.venv/bin/python -m {module} " + shlex.join(sys.argv[1:] if argv is None else argv)
