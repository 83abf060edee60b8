"""The shipped DeepSeek-V3-shaped model (models/pdserve-tiny) meets the goals stated in its model card."""

from __future__ import annotations

import json
import re

import pytest
import torch
from tokenizers import Tokenizer
from transformers import DeepseekV3ForCausalLM

from engine.models.dflash import load_draft
from engine.paths import DSV3_MODEL_DIR
from training import evaluate

pytestmark = pytest.mark.slow  # evaluates the trained model: held-out loss and draft acceptance

MODEL_DIR = DSV3_MODEL_DIR


def card_value(key: str) -> float:
    """A number from the model card's YAML front matter."""
    match = re.search(rf"^{key}: ([0-9.]+)$", (MODEL_DIR / "README.md").read_text(), re.MULTILINE)
    assert match, f"{key} missing from the model card"
    return float(match.group(1))


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))


@pytest.fixture(scope="module")
def target() -> DeepseekV3ForCausalLM:
    return DeepseekV3ForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32, experts_implementation="eager").eval()


def test_shapes_and_size_budget() -> None:
    """Architecture constraints of the issue; <= 10M target parameters; <= 25 MB on disk in all."""
    config = json.loads((MODEL_DIR / "config.json").read_text())
    assert config["num_attention_heads"] == 24 and config["q_lora_rank"] and config["kv_lora_rank"] >= 64
    assert config["first_k_dense_replace"] >= 1 and config["num_hidden_layers"] - config["first_k_dense_replace"] >= 2
    assert config["n_routed_experts"] >= 8 and config["num_experts_per_tok"] == 2 and config["n_shared_experts"] == 1
    assert config["max_position_embeddings"] >= 16384 and config["vocab_size"] % 64 == 0
    size = sum(p.stat().st_size for p in MODEL_DIR.rglob("*") if p.is_file())
    assert size <= 25 * 1024 * 1024, size


def test_held_out_loss_below_unigram_threshold(target, corpus_tokens) -> None:
    """Next-token loss on the fixed held-out slice <= threshold (card) x unigram entropy of the slice."""
    train_counts, held_stream = corpus_tokens
    windows = evaluate.held_out_slice(held_stream, 256, 64)
    loss = evaluate.model_loss(target, windows)
    entropy = evaluate.unigram_entropy(train_counts, target.config.vocab_size, windows)
    threshold = card_value("loss_ratio_threshold")
    print(f"held-out loss {loss:.4f} nats, unigram entropy {entropy:.4f} nats, ratio {loss / entropy:.4f}")
    assert threshold <= 0.60
    assert loss / entropy <= threshold


def test_draft_acceptance_length(target, corpus_tokens) -> None:
    """Greedy draft-then-verify at block size 8 accepts >= 3.0 tokens per verify step on held-out prompts."""
    _, held_stream = corpus_tokens
    draft = load_draft(MODEL_DIR / "draft")
    stride = (held_stream.numel() - 32) // 12
    prompts = [held_stream[i * stride : i * stride + 32].tolist() for i in range(12)]
    accepted, per_position = evaluate.acceptance_length(target, draft, prompts, block_size=8, new_tokens=64)
    print(f"acceptance length {accepted:.3f}, per position {per_position}")
    assert accepted >= 3.0


@pytest.mark.parametrize("text", ["héllo wörld", "数据 = {'κλειδί': '值'}  # 🙂", "\t\n  ünïcödé\r\n"])
def test_tokenizer_round_trips_non_ascii(tokenizer: Tokenizer, text: str) -> None:
    """Byte-level BPE: decode(encode(text)) == text for multi-byte characters."""
    ids = tokenizer.encode(text).ids
    assert max(ids) < tokenizer.get_vocab_size()
    assert tokenizer.decode(ids) == text
