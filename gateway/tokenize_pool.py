"""Tokenisation off the gateway's event loop.

HF `tokenizers` holds the GIL while it encodes (measured: a 930 KB text takes ~2 s and the other
threads of the process barely run meanwhile), so a thread pool would not free the event loop. Texts
longer than `inline_chars` are encoded in a small pool of spawned processes (spawn, not fork: the
gateway runs gRPC threads), each holding its own copy of the tokenizer; short texts, the common case,
are encoded inline, where a process round trip would cost more than the encoding."""
from __future__ import annotations

import asyncio
import logging
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from gateway.tokenizer import TextTokenizer

logger = logging.getLogger(__name__)

_WORKER_TOKENIZER: TextTokenizer | None = None


def _load(path: str) -> None:
    global _WORKER_TOKENIZER  # noqa: PLW0603 - one tokenizer per pool process
    _WORKER_TOKENIZER = TextTokenizer.from_file(path)


def _encode(text: str) -> list[int]:
    assert _WORKER_TOKENIZER is not None
    return _WORKER_TOKENIZER.encode(text)


@dataclass(frozen=True)
class TokenizePoolConfig:
    """inline_chars: texts up to this many characters are encoded on the calling thread.
    processes: pool size (0: everything inline, e.g. in tests of the pure parts)."""

    inline_chars: int = 4096
    processes: int = 1

    def __post_init__(self) -> None:
        if self.inline_chars < 0 or self.processes < 0:
            raise ValueError("inline_chars and processes must be non-negative")


class TokenizePool:
    def __init__(self, tokenizer: TextTokenizer, tokenizer_path: str | Path | None,
                 config: TokenizePoolConfig = TokenizePoolConfig()) -> None:
        self.tokenizer = tokenizer
        self.config = config
        self._executor: ProcessPoolExecutor | None = None
        if config.processes and tokenizer_path is not None:
            self._executor = ProcessPoolExecutor(
                config.processes, mp_context=multiprocessing.get_context("spawn"), initializer=_load,
                initargs=(str(tokenizer_path),))

    async def warm_up(self) -> None:
        """Starts the pool's processes now (a spawned process takes a while to import), not on the first
        long prompt."""
        if self._executor is not None:
            await asyncio.get_running_loop().run_in_executor(self._executor, _encode, "warm up")

    async def encode(self, text: str) -> list[int]:
        if self._executor is None or len(text) <= self.config.inline_chars:
            return self.tokenizer.encode(text)
        return await asyncio.get_running_loop().run_in_executor(self._executor, _encode, text)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
