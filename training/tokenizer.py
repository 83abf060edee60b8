"""Byte-level BPE tokenizer for the default model (HF ``tokenizers``)."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from training.corpus import Corpus

logger = logging.getLogger(__name__)

BOS, EOS, PAD, MASK = "<|bos|>", "<|eos|>", "<|pad|>", "<|mask|>"
SPECIAL_TOKENS = (BOS, EOS, PAD, MASK)  # ids 0, 1, 2, 3


def train_tokenizer(texts: Sequence[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE on ``texts``; special tokens get ids 0..3.

    Byte-level pre-tokenisation and decoding make every string (any Unicode)
    encodable and round-trip exactly.
    """
    if vocab_size % 64 != 0:
        raise ValueError(f"vocab_size must be a multiple of 64 (TP split), got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    for index, token in enumerate(SPECIAL_TOKENS):
        if tokenizer.token_to_id(token) != index:
            raise RuntimeError(f"special token {token} got id {tokenizer.token_to_id(token)}, expected {index}")
    logger.info("tokenizer trained: vocab %d", tokenizer.get_vocab_size())
    return tokenizer


def encode_documents(tokenizer: Tokenizer, texts: Sequence[str]) -> list[list[int]]:
    """Each document as [bos, ...tokens..., eos]."""
    bos, eos = tokenizer.token_to_id(BOS), tokenizer.token_to_id(EOS)
    return [[bos, *enc.ids, eos] for enc in tokenizer.encode_batch(list(texts), add_special_tokens=False)]


@dataclass(frozen=True)
class EncodedCorpus:
    """The corpus as token ids: the training documents, and each split as one 1-D stream of documents."""

    train_docs: list[list[int]]
    train_stream: torch.Tensor
    held_stream: torch.Tensor


def encode_corpus(tokenizer: Tokenizer, corpus: Corpus) -> EncodedCorpus:
    train_docs = encode_documents(tokenizer, [d.text for d in corpus.train])
    held_docs = encode_documents(tokenizer, [d.text for d in corpus.held_out])
    encoded = EncodedCorpus(train_docs, torch.tensor([t for doc in train_docs for t in doc]),
                            torch.tensor([t for doc in held_docs for t in doc]))
    logger.info("tokens: train %d, held-out %d", encoded.train_stream.numel(), encoded.held_stream.numel())
    return encoded


def special_ids(tokenizer: Tokenizer) -> dict[str, int]:
    """{"bos", "eos", "pad", "mask"} -> id."""
    return {name: tokenizer.token_to_id(token) for name, token in zip(("bos", "eos", "pad", "mask"), SPECIAL_TOKENS)}


def write_tokenizer_config(out: Path) -> None:
    """out/tokenizer_config.json: the special tokens, for transformers' PreTrainedTokenizerFast."""
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "mask_token": MASK,
         "tokenizer_class": "PreTrainedTokenizerFast"}, indent=2) + "\n")
