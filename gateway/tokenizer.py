"""Text <-> token ids with the model's own tokenizer.json (HF `tokenizers`)."""
from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer


class TextTokenizer:
    """A thin, typed wrapper; thread-safe for encode/decode (the Rust tokenizer is immutable here)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer

    @classmethod
    def from_file(cls, path: str | Path) -> TextTokenizer:
        return cls(Tokenizer.from_file(str(path)))

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> TextTokenizer | None:
        """The directory's tokenizer.json, or None when it has none (token-id requests only)."""
        path = Path(model_dir) / "tokenizer.json"
        return cls.from_file(path) if path.exists() else None

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json text (for llguidance's grammar compiler)."""
        return self._tokenizer.to_str()

    def token_to_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)
