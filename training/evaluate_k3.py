"""Metrics of the K3-shaped default model, measured on the SAVED checkpoint through the serving engine.

- held-out loss: engine.LLM(model_dir).logits over the held-out windows (training/evaluate.py's
  held_out_slice: consecutive windows of length + 1 tokens, context restarting at each window), mean
  next-token cross-entropy in nats; ratio = loss / the training unigram's cross-entropy on the same tokens.
- acceptance length: the engine's real speculative decoding (greedy, DSpark draft with its Markov head,
  verify block `block` = gamma + 1 tokens), read from the engine's acceptance counters: tokens emitted per
  verify step = (accepted drafts + steps) / steps, bonus token included.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from engine import LLM, SamplingParams


def engine_loss(model_dir: Path, windows: torch.Tensor, threads: int) -> float:
    """Mean cross-entropy (nats) of windows[:, 1:] given the preceding tokens, engine logits, no draft."""
    with LLM(str(model_dir), draft_model="", device="cpu", num_threads=threads) as llm:
        total = 0.0
        for window in windows:
            logits = llm.logits(window[:-1].tolist()).float()
            total += F.cross_entropy(logits, window[1:], reduction="sum").item()
    return total / windows[:, 1:].numel()


def engine_greedy(model_dir: Path, prompts: Sequence[Sequence[int]], new_tokens: int, batch: int,
                  threads: int) -> list[list[int]]:
    """Greedy continuations (eos ignored) from the engine, no draft: prompt + new tokens per prompt."""
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    with LLM(str(model_dir), draft_model="", device="cpu", num_threads=threads, max_running=batch) as llm:
        outputs = llm.generate([list(p) for p in prompts], params)
    return [list(p) + out for p, out in zip(prompts, outputs)]


def engine_acceptance(model_dir: Path, prompts: Sequence[Sequence[int]], new_tokens: int, block: int,
                      threads: int) -> tuple[float, list[float], int]:
    """(tokens per verify step, per-position acceptance rates given reached, verify steps), greedy, batched."""
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True, block_size=block)
    with LLM(str(model_dir), device="cpu", num_threads=threads, spec_block_size=block,
             max_running=len(prompts)) as llm:
        if not llm.engine.has_draft:
            raise ValueError(f"{model_dir} has no draft/ to measure acceptance with")
        llm.generate([list(p) for p in prompts], params)
        stats = llm.acceptance_stats
        rates = [a / n if n else 0.0 for a, n in zip(stats.position_accepted, stats.position_attempted)]
        return (stats.num_accepted_drafts + stats.num_verify_steps) / stats.num_verify_steps, rates, stats.num_verify_steps
