"""The shipped models' corpus, tokenized once per test run: the training split's unigram counts (for the
loss-vs-unigram goal) and the held-out token stream (~15 CPU seconds to encode 3.4M training tokens)."""
from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer

from engine.paths import DSV3_MODEL_DIR
from tests.run_wide import run_wide
from training import evaluate
from training.corpus import load_corpus
from training.tokenizer import encode_documents

VOCAB_SIZE = 4096  # both shipped models (pdserve-tiny, pdserve-k3-tiny) share this tokenizer


@pytest.fixture(scope="session")
def corpus_tokens(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.Tensor, torch.Tensor]:
    """(training unigram counts [VOCAB_SIZE] float64, held-out token stream), encoded with the shipped
    tokenizer by the first xdist worker that needs them and read back by the others."""
    with run_wide(tmp_path_factory, "corpus_tokens") as root:
        saved = root / "tokens.pt"
        if not saved.exists():
            tokenizer = Tokenizer.from_file(str(DSV3_MODEL_DIR / "tokenizer.json"))
            assert tokenizer.get_vocab_size() == VOCAB_SIZE
            corpus = load_corpus()
            train = encode_documents(tokenizer, [d.text for d in corpus.train])
            held = encode_documents(tokenizer, [d.text for d in corpus.held_out])
            torch.save({"counts": evaluate.unigram_counts(train, VOCAB_SIZE),
                        "held": torch.tensor([t for doc in held for t in doc])}, saved)
        tokens = torch.load(saved)
        return tokens["counts"], tokens["held"]
