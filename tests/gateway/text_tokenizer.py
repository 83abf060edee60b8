"""A small byte-level BPE tokenizer.json (HF `tokenizers`) for tests that need text, with the special
tokens of the default model (<|bos|> <|eos|> <|pad|> <|mask|>) and multi-byte characters in its corpus."""
from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|mask|>"]
CORPUS = [
    "def main(argv):\n    return 0\n", "import os, sys\nprint('hello world')\n",
    "naïve café résumé déjà vu", "日本語のテキストと中文字符", "emoji 🙂🚀 and ∑ ≠ ∞ math",
    "The quick brown fox jumps over the lazy dog.", "for index in range(10):\n    total += index\n",
]


def make_tokenizer(path: str | Path, vocab_size: int = 300) -> Path:
    """Trains on CORPUS (deterministic) and writes tokenizer.json at path (a directory or a file)."""
    path = Path(path)
    target = path / "tokenizer.json" if path.suffix != ".json" else path
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(CORPUS * 4, trainer)
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer.save(str(target))
    return target
