"""Held-out acceptance of one or more DFlash drafts against the pdserve-tiny target (training/evaluate.py's
acceptance_length: greedy draft-then-verify with the transformers target, bonus token counted), to compare
drafts on the same prompts before replacing the embedded one.

    .venv/bin/python -m training.evaluate_draft --drafts /tmp/old_draft models/pdserve-tiny/draft \\
        --prompt-length 64 --new-tokens 128
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer
from transformers import DeepseekV3ForCausalLM

from engine.models.dflash import load_draft
from training import evaluate
from training.corpus import load_corpus
from training.tokenizer import encode_corpus

logger = logging.getLogger("training")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=Path("models/pdserve-tiny"), help="target directory")
    parser.add_argument("--drafts", type=Path, nargs="+", required=True, help="draft directories to measure")
    parser.add_argument("--prompt-length", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=24, help="prompts spread evenly over the held-out stream")
    parser.add_argument("--block-size", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    for name in ("prompt_length", "new_tokens", "prompts", "block_size"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s [training] %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    tokenizer = Tokenizer.from_file(str(args.model / "tokenizer.json"))
    held_stream = encode_corpus(tokenizer, load_corpus()).held_stream
    prompts = evaluate.acceptance_prompts(held_stream, args.prompt_length, args.prompts)
    target = DeepseekV3ForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    results = {}
    for draft_dir in args.drafts:
        accept, per_position = evaluate.acceptance_length(target, load_draft(draft_dir), prompts, args.block_size,
                                                          args.new_tokens)
        results[str(draft_dir)] = {"acceptance_length": accept, "acceptance_per_position": per_position}
        logger.info("%s: %.3f tokens per verify step; per position %s", draft_dir, accept,
                    " ".join(f"{r:.2f}" for r in per_position))
    json.dump({"prompts": len(prompts), "prompt_length": args.prompt_length, "new_tokens": args.new_tokens,
               "block_size": args.block_size, "drafts": results}, sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
