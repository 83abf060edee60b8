"""Entry point: build models/pdserve-tiny (tokenizer, target, draft, model card) from scratch.

    .venv/bin/python -m training.train_default_model --out models/pdserve-tiny --seed 0

``--tiny`` trains a toy configuration for a few steps (smoke tests only).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
from tokenizers import Tokenizer
from transformers import DeepseekV3ForCausalLM, GenerationConfig

from engine import LLM
from engine.models.dflash import DFlashConfig, load_draft, save_draft
from training import evaluate
from training.block_draft import DistillText
from training.corpus import load_corpus
from training.model_card import write_model_card
from training.options import base_parser, command_line, start_run
from training.target_shape import TargetShape, build_config
from training.tokenizer import encode_corpus, special_ids, train_tokenizer, write_tokenizer_config
from training.train_draft import DRAFT_SCHEDULE, DraftTraining, build_dataset, engine_continuations, train_draft
from training.train_target import TARGET_SCHEDULE, TargetTraining, train_target

logger = logging.getLogger("training")

LOSS_RATIO_THRESHOLD = 0.60
SAMPLE_PROMPTS = ("import os\n", "def __init__(self", "class ")
TINY = {
    "shape": TargetShape(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                         num_hidden_layers=3, num_attention_heads=4, q_lora_rank=32, kv_lora_rank=32,
                         qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=4,
                         train_length=64, max_position_embeddings=1024),
    "target": TargetTraining(steps=3, schedule=TARGET_SCHEDULE.smoke()),
    "draft": DraftTraining(text=DistillText(num_sequences=4, prompt_length=8, generated_length=24, generate_batch=4),
                           steps=3, anchors_per_sequence=4, schedule=DRAFT_SCHEDULE.smoke()),
    "accept_prompt_length": 8, "accept_new_tokens": 8, "bench_prompt_length": 16, "bench_new_tokens": 8,
    "sample_tokens": 4,
}
FULL = {"shape": TargetShape(), "target": TargetTraining(), "draft": DraftTraining(), "accept_prompt_length": 32,
        "accept_new_tokens": 96, "bench_prompt_length": 64, "bench_new_tokens": 128, "sample_tokens": 48}
DRAFT_KEYS = ("acceptance_length", "acceptance_per_position", "accept_prompts", "accept_prompt_length",
              "accept_new_tokens", "acceptance_length_64_128", "acceptance_per_position_64_128", "draft_steps",
              "draft_batch", "draft_lr", "draft_sequences", "draft_generated", "draft_anchors", "draft_prompt_min",
              "draft_prompt_max", "draft_init", "draft_minutes", "draft_command", "train_minutes", "wall_minutes",
              "draft_seed", "draft_max_steps", "draft_budget_minutes")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = base_parser(__doc__, Path("models/pdserve-tiny"), threads=2)
    parser.add_argument("--reuse-target", action="store_true",
                        help="keep the tokenizer and target already in --out; retrain only the draft")
    parser.add_argument("--draft-init", type=Path, default=None,
                        help="warm-start the draft from this draft directory (same shape) instead of a fresh draw")
    parser.add_argument("--draft-sequences", type=int, default=None, help="distilled sequences (default 2048)")
    parser.add_argument("--draft-prompt-lengths", type=int, nargs=2, metavar=("MIN", "MAX"), default=None,
                        help="distillation prompts of MIN..MAX tokens, continued to MAX + the generated length")
    parser.add_argument("--draft-lr", type=float, default=None, help="draft peak learning rate (default 2e-3)")
    parser.add_argument("--draft-minutes", type=float, default=None,
                        help="wall-clock budget of the draft phase (data generation + training): the update loop "
                             "gets what the data left and stops at --draft-steps or the budget, the cosine "
                             "decaying over whichever runs out first")
    parser.add_argument("--engine-distill", action="store_true",
                        help="generate the draft's distillation text with the serving engine (greedy, ~15x faster "
                             "on CPU) instead of transformers' generate loop")
    return parser.parse_args(argv)


def draft_plan(cfg: DraftTraining, args: argparse.Namespace) -> DraftTraining:
    """The plan's draft training with the command line's overrides."""
    text = cfg.text
    if args.draft_sequences is not None:
        text = replace(text, num_sequences=args.draft_sequences)
    if args.draft_prompt_lengths is not None:
        low, high = args.draft_prompt_lengths
        text = replace(text, prompt_length=high, min_prompt_length=low)
    schedule = cfg.schedule if args.draft_lr is None else replace(cfg.schedule, lr=args.draft_lr)
    return replace(cfg, text=text, schedule=schedule,
                   steps=cfg.steps if args.draft_steps is None else args.draft_steps)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    scale = start_run(args)
    torch.manual_seed(args.seed)
    plan = TINY if args.tiny else FULL
    target_cfg, draft_cfg = plan["target"], plan["draft"]
    if args.target_steps is not None:
        target_cfg = replace(target_cfg, steps=args.target_steps)
    draft_cfg = draft_plan(draft_cfg, args)
    started = time.monotonic()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)

    corpus = load_corpus(max_files=scale.max_files)
    shape: TargetShape = plan["shape"]
    if args.reuse_target:
        tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    else:
        tokenizer = train_tokenizer([d.text for d in corpus.train], shape.vocab_size)
        tokenizer.save(str(out / "tokenizer.json"))
    special = special_ids(tokenizer)
    write_tokenizer_config(out)
    encoded = encode_corpus(tokenizer, corpus)
    train_docs, train_stream, held_stream = encoded.train_docs, encoded.train_stream, encoded.held_stream

    config = build_config(shape, special["bos"], special["eos"], special["pad"])
    if not args.reuse_target:
        model = train_target(config, train_stream, target_cfg, args.seed)
        model.generation_config = GenerationConfig(
            bos_token_id=special["bos"], eos_token_id=special["eos"], pad_token_id=special["pad"], do_sample=False)
        model.to(torch.bfloat16).save_pretrained(out)
    target_time = time.monotonic() - started
    reused_from = None
    if args.reuse_target:
        reused_from = json.loads((out / "training_metrics.json").read_text())
        target_time = reused_from["target_minutes"] * 60
        started -= target_time  # wall times below add the earlier run's target phase
    # grouped_mm: the same greedy tokens as "eager" here, ~2x faster batched generation (distillation data)
    experts = "grouped_mm" if hasattr(torch.nn.functional, "grouped_mm") or hasattr(torch, "_grouped_mm") else "eager"
    target = DeepseekV3ForCausalLM.from_pretrained(out, dtype=torch.float32, experts_implementation=experts).eval()
    num_params = sum(p.numel() for p in target.parameters())
    logger.info("target phase done after %.1f min", target_time / 60)
    draft_started = time.monotonic()

    layers = shape.num_hidden_layers
    draft_config = DFlashConfig(
        hidden_size=shape.hidden_size, target_hidden_size=shape.hidden_size,
        target_layer_ids=(0, layers // 2), block_size=8, mask_token_id=special["mask"], rms_norm_eps=1e-6,
        rope_theta=10000.0, **scale.draft_shape.as_kwargs())
    llm = LLM(str(out), draft_model="", num_threads=args.threads,
              max_running=draft_cfg.text.generate_batch) if args.engine_distill else None
    data = build_dataset(target, train_stream, draft_cfg, draft_config.target_layer_ids, args.seed,
                         engine_continuations(llm) if llm is not None else None)
    if llm is not None:
        llm.close()
    if args.draft_minutes is not None:
        left = args.draft_minutes - (time.monotonic() - draft_started) / 60
        if left <= 0:
            raise ValueError(f"--draft-minutes {args.draft_minutes}: the distillation data alone took longer")
        draft_cfg = replace(draft_cfg, minutes=left)
    draft, draft_steps = train_draft(target, draft_config, data, draft_cfg, args.seed, args.draft_init)
    draft_params = sum(p.numel() for p in draft.parameters())
    save_draft(draft, out / "draft")
    draft = load_draft(out / "draft")
    train_time, draft_time = time.monotonic() - started, time.monotonic() - draft_started

    windows = evaluate.held_out_slice(held_stream, shape.train_length, scale.eval_windows)
    loss = evaluate.model_loss(target, windows)
    entropy = evaluate.unigram_entropy(train_docs, shape.vocab_size, windows)
    length = plan["accept_prompt_length"]
    prompts = evaluate.acceptance_prompts(held_stream, length, scale.accept_prompts)
    accept, per_position = evaluate.acceptance_length(target, draft, prompts, 8, plan["accept_new_tokens"])
    bench_prompts = evaluate.acceptance_prompts(held_stream, plan["bench_prompt_length"], scale.accept_prompts)
    bench_accept, bench_per_position = evaluate.acceptance_length(target, draft, bench_prompts, 8,
                                                                  plan["bench_new_tokens"])
    samples = {p: tokenizer.decode(evaluate.greedy_text(target, tokenizer.encode(p).ids, plan["sample_tokens"]))
               for p in SAMPLE_PROMPTS}
    metrics = {
        "seed": args.seed, "threads": args.threads, "python_version": corpus.python_version, "stdlib": corpus.root,
        "train_files": len(corpus.train), "held_out_files": len(corpus.held_out), "skipped_files": len(corpus.skipped),
        "train_bytes": corpus.train_bytes, "held_out_bytes": corpus.held_out_bytes,
        "train_tokens": train_stream.numel(), "held_out_tokens": held_stream.numel(),
        "target_parameters": num_params, "draft_parameters": draft_params,
        "held_out_loss": loss, "unigram_entropy": entropy, "loss_ratio": loss / entropy,
        "loss_ratio_threshold": LOSS_RATIO_THRESHOLD, "eval_windows": scale.eval_windows,
        "eval_length": shape.train_length, "acceptance_length": accept, "acceptance_per_position": per_position,
        "accept_prompts": len(prompts), "accept_prompt_length": length, "accept_new_tokens": plan["accept_new_tokens"],
        "target_steps": target_cfg.steps, "target_batch": target_cfg.schedule.batch_size,
        "target_lr": target_cfg.schedule.lr, "target_warmup": target_cfg.schedule.warmup_steps,
        "draft_steps": draft_steps, "draft_batch": draft_cfg.schedule.batch_size, "draft_lr": draft_cfg.schedule.lr,
        "draft_sequences": draft_cfg.text.num_sequences, "draft_generated": draft_cfg.text.generated_length,
        "draft_anchors": draft_cfg.anchors_per_sequence, "target_minutes": target_time / 60,
        "draft_prompt_min": draft_cfg.text.min_prompt_length or draft_cfg.text.prompt_length,
        "draft_prompt_max": draft_cfg.text.prompt_length, "draft_init": args.draft_init and str(args.draft_init),
        "draft_minutes": draft_time / 60, "acceptance_length_64_128": bench_accept,
        "acceptance_per_position_64_128": bench_per_position,
        "wall_minutes": (time.monotonic() - started) / 60, "train_minutes": train_time / 60,
        "draft_max_steps": draft_cfg.steps, "draft_budget_minutes": args.draft_minutes,
        "draft_rerun": args.reuse_target, "draft_distill": "engine" if args.engine_distill else "transformers",
        "command": command_line("", "training.train_default_model", argv),
    }
    if reused_from is not None:
        metrics["draft_command"], metrics["command"] = metrics["command"], reused_from["command"]
        metrics["draft_threads"], metrics["threads"] = args.threads, reused_from["threads"]
        metrics["draft_seed"], metrics["seed"] = args.seed, reused_from["seed"]  # the target's seed stays
        metrics["previous_draft"] = {k: reused_from[k] for k in DRAFT_KEYS if k in reused_from}
    logger.info("metrics: %s", json.dumps(metrics, indent=1))
    (out / "training_metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    for prompt, text in samples.items():
        logger.info("sample %r -> %r", prompt, text)
    write_model_card(out / "README.md", metrics, samples, json.loads((out / "config.json").read_text()),
                     json.loads((out / "draft" / "config.json").read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
