"""Entry point: build models/pdserve-k3-tiny (K3-shaped target + DSpark draft + metrics + model card).

    OMP_NUM_THREADS=1 .venv/bin/python -m training.train_k3_default_model --out models/pdserve-k3-tiny

Phases (--phase, default all): target (train, export every few minutes: a partial run is loadable),
draft (engine-generated data, taps, DSpark training, draft/), eval (engine loss + engine speculative
acceptance, training_metrics.json, README.md). Each phase reads what the previous one saved, so they can
run as separate commands. The tokenizer is models/pdserve-tiny's (same corpus, same vocabulary).
--tiny: toy shapes and seconds of training (smoke tests). One thread is the default: on a shared,
oversubscribed machine two intra-op threads spin on each other and run ~10x slower.
"""
from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
from tokenizers import Tokenizer

from engine.model_configs.model_config import RopeConfig
from engine.models.dflash import DFlashConfig
from engine.models.dspark import load_dspark, save_dspark
from engine.models.dspark_config import DSparkConfig
from training import evaluate, evaluate_k3
from training.block_draft import DistillText, sample_prompts
from training.corpus import load_corpus
from training.k3_export import load_k3, save_k3
from training.k3_model_card import write_k3_model_card
from training.k3_shape import K3Shape, k3_config_dict
from training.k3_warm_start import warm_start
from training.options import Scale, base_parser, command_line, start_run
from training.tokenizer import encode_corpus, special_ids, write_tokenizer_config
from training.train_dspark import DSPARK_SCHEDULE, DSparkTraining, capture_taps, train_dspark
from training.train_k3_target import K3_TARGET_SCHEDULE, K3TargetTraining, train_k3_target

logger = logging.getLogger("training")

LOSS_RATIO_THRESHOLD = 0.60
ACCEPTANCE_THRESHOLD = 3.0
VERIFY_BLOCK = 8  # gamma 7 drafts + the bonus token per verify step
WARM_START_SOURCE = Path(__file__).resolve().parent.parent / "models" / "pdserve-tiny"
TOKENIZER_SOURCE = WARM_START_SOURCE / "tokenizer.json"
TINY = {
    "shape": K3Shape(hidden_size=64, num_heads=4, kda_head_dim=8, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=8,
                     qk_rope_head_dim=8, v_head_dim=8, intermediate_size=128, moe_intermediate_size=32,
                     routed_expert_hidden_size=32, train_length=64),
    "target": K3TargetTraining(budget=K3TargetTraining().budget.override(3, None),
                               schedule=K3_TARGET_SCHEDULE.smoke()),
    "draft": DSparkTraining(text=DistillText(num_sequences=8, prompt_length=8, generated_length=24, generate_batch=8),
                            budget=DSparkTraining().budget.override(3, None), anchors_per_sequence=4,
                            schedule=DSPARK_SCHEDULE.smoke()),
    "markov_rank": 8, "accept_new_tokens": 16,
}
FULL = {"shape": K3Shape(train_length=128), "target": K3TargetTraining(), "draft": DSparkTraining(), "markov_rank": 64,
        "accept_new_tokens": 96}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = base_parser(__doc__, Path("models/pdserve-k3-tiny"), threads=1)
    parser.add_argument("--work-dir", type=Path, default=None, help="resumable trainer state (default: a temp dir)")
    parser.add_argument("--phase", choices=("all", "target", "draft", "eval"), default="all")
    parser.add_argument("--warm-start", type=Path, default=WARM_START_SOURCE,
                        help="initialise the shared-shape tensors from this DeepSeek-V3 default model ('' = none)")
    parser.add_argument("--target-minutes", type=float, default=None)
    parser.add_argument("--draft-minutes", type=float, default=None)
    parser.add_argument("--draft-sequences", type=int, default=None, help="engine-generated training sequences")
    parser.add_argument("--draft-init", type=Path, default=None,
                        help="continue training this DSpark draft directory (same shape) instead of a fresh draft")
    return parser.parse_args(argv)


def draft_config(scale: Scale, shape: K3Shape, markov_rank: int, mask_id: int) -> DSparkConfig:
    layers = shape.num_hidden_layers
    backbone = DFlashConfig(hidden_size=shape.hidden_size, target_layer_ids=(layers // 2 - 1, layers - 1),
                            target_hidden_size=shape.hidden_size, block_size=VERIFY_BLOCK - 1, mask_token_id=mask_id,
                            rms_norm_eps=1e-6, **scale.draft_shape.as_kwargs())
    return DSparkConfig(backbone=backbone, vocab_size=shape.vocab_size, markov_rank=markov_rank,
                        rope=RopeConfig(), use_confidence_head=False)


DRAFT_ROUND_KEYS = ("draft_command", "draft_steps", "draft_train_minutes", "draft_final_train_loss", "draft_sequences",
                    "draft_minutes")


def previous_draft_rounds(out: Path) -> list[dict]:
    """Before a draft phase that continues a draft (--draft-init): the rounds recorded so far in out's metrics
    (the earlier rounds, then the last one), which the model card lists ahead of this round."""
    path = out / "training_metrics.json"
    metrics = json.loads(path.read_text()) if path.exists() else {}
    if "draft_command" not in metrics:
        return []
    return [*metrics.get("draft_previous_rounds", []), {key: metrics[key] for key in DRAFT_ROUND_KEYS if key in metrics}]


def update_metrics(out: Path, values: dict) -> dict:
    path = out / "training_metrics.json"
    metrics = json.loads(path.read_text()) if path.exists() else {}
    metrics.update(values)
    path.write_text(json.dumps(metrics, indent=1) + "\n")
    return metrics


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    scale = start_run(args)
    plan = TINY if args.tiny else FULL
    shape: K3Shape = plan["shape"]
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    work = args.work_dir or Path(tempfile.gettempdir()) / f"k3-train-{out.resolve().name}"
    command = command_line("OMP_NUM_THREADS=1 ", "training.train_k3_default_model", argv)

    corpus = load_corpus(max_files=scale.max_files)
    tokenizer = Tokenizer.from_file(str(TOKENIZER_SOURCE))
    if tokenizer.get_vocab_size() != shape.vocab_size:
        raise ValueError(f"tokenizer vocab {tokenizer.get_vocab_size()} != model vocab {shape.vocab_size}")
    special = special_ids(tokenizer)
    encoded = encode_corpus(tokenizer, corpus)
    train_docs, train_stream, held_stream = encoded.train_docs, encoded.train_stream, encoded.held_stream
    config = k3_config_dict(shape, special["bos"], special["eos"], special["pad"])

    if args.phase in ("all", "target"):
        shutil.copy(TOKENIZER_SOURCE, out / "tokenizer.json")
        write_tokenizer_config(out)
        (out / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": special["bos"], "eos_token_id": special["eos"], "pad_token_id": special["pad"],
             "do_sample": False}, indent=2) + "\n")
        cfg = plan["target"]
        cfg = replace(cfg, budget=cfg.budget.override(args.target_steps, args.target_minutes))
        source = None if args.tiny or not str(args.warm_start) else args.warm_start
        init = None if source is None else (lambda net: warm_start(net, source))
        _, summary = train_k3_target(shape, train_stream, cfg, args.seed, work, lambda net: save_k3(net, out, config), init)
        update_metrics(out, {
            "target_command": command, "seed": args.seed, "threads": args.threads, "shape": vars(shape),
            "python_version": corpus.python_version, "train_files": len(corpus.train),
            "held_out_files": len(corpus.held_out), "train_tokens": train_stream.numel(),
            "held_out_tokens": held_stream.numel(), "target_steps": summary["steps"],
            "target_minutes": summary["minutes"], "target_final_train_loss": summary["final_loss"],
            "target_batch": cfg.schedule.batch_size, "target_lr": cfg.schedule.lr,
            "target_budget_minutes": cfg.budget.minutes,
            "warm_start": None if source is None else str(source.resolve().relative_to(Path.cwd().resolve()))
            if source.resolve().is_relative_to(Path.cwd().resolve()) else str(source)})

    if args.phase in ("all", "draft"):
        started = time.monotonic()
        cfg = plan["draft"]
        cfg = replace(cfg, budget=cfg.budget.override(args.draft_steps, args.draft_minutes),
                      text=replace(cfg.text, num_sequences=args.draft_sequences or cfg.text.num_sequences))
        target = load_k3(shape, out)
        prompts = sample_prompts(train_stream, cfg.text, args.seed).tolist()
        tokens = torch.tensor(evaluate_k3.engine_greedy(out, prompts, cfg.text.generated_length,
                                                        cfg.text.generate_batch, args.threads))
        logger.info("draft data: %d sequences generated in %.1f min", len(prompts), (time.monotonic() - started) / 60)
        dconfig = draft_config(scale, shape, plan["markov_rank"], special["mask"])
        taps = capture_taps(target, tokens, dconfig.target_layer_ids)
        init = load_dspark(args.draft_init) if args.draft_init else None
        rounds = previous_draft_rounds(out) if init is not None else []
        draft, summary = train_dspark(target, dconfig, tokens, taps, cfg, args.seed, init)
        save_dspark(draft, out / "draft")
        update_metrics(out, {
            "draft_command": command, "draft_parameters": sum(p.numel() for p in draft.parameters()),
            "draft_steps": summary["steps"], "draft_train_minutes": summary["minutes"],
            "draft_final_train_loss": summary["final_loss"], "draft_sequences": cfg.text.num_sequences,
            "draft_generated": cfg.text.generated_length, "draft_batch": cfg.schedule.batch_size,
            "draft_lr": cfg.schedule.lr,
            "draft_minutes": (time.monotonic() - started) / 60, "draft_previous_rounds": rounds})

    if args.phase in ("all", "eval"):
        windows = evaluate.held_out_slice(held_stream, shape.train_length, scale.eval_windows)
        loss = evaluate_k3.engine_loss(out, windows, args.threads)
        entropy = evaluate.unigram_entropy(train_docs, shape.vocab_size, windows)
        length = plan["draft"].text.prompt_length
        prompts = evaluate.acceptance_prompts(held_stream, length, scale.accept_prompts)
        accept, per_position, steps = evaluate_k3.engine_acceptance(out, prompts, plan["accept_new_tokens"],
                                                                    VERIFY_BLOCK, args.threads)
        samples = {p: tokenizer.decode(evaluate_k3.engine_greedy(out, [tokenizer.encode(p).ids], 40, 1, args.threads)[0][
            len(tokenizer.encode(p).ids):]) for p in ("import os\n", "def __init__(self", "class ")}
        sizes = {"target_bytes": (out / "model.safetensors").stat().st_size,
                 "draft_bytes": sum(f.stat().st_size for f in (out / "draft").iterdir())}
        metrics = update_metrics(out, {
            "held_out_loss": loss, "unigram_entropy": entropy, "loss_ratio": loss / entropy,
            "loss_ratio_threshold": LOSS_RATIO_THRESHOLD, "eval_windows": scale.eval_windows,
            "eval_length": shape.train_length, "acceptance_length": accept, "acceptance_per_position": per_position,
            "acceptance_threshold": ACCEPTANCE_THRESHOLD, "verify_block": VERIFY_BLOCK, "verify_steps": steps,
            "accept_prompts": len(prompts), "accept_prompt_length": length,
            "accept_new_tokens": plan["accept_new_tokens"], **sizes,
            "total_megabytes": (sizes["target_bytes"] + sizes["draft_bytes"]) / 1e6,
            "target_parameters": sum(p.numel() for p in load_k3(shape, out).parameters()),
            "eval_command": command})
        logger.info("metrics: %s", json.dumps(metrics, indent=1))
        write_k3_model_card(out / "README.md", metrics, samples, config, json.loads((out / "draft" / "config.json").read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
