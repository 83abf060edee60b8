"""Benchmark prompts: random token ids of given lengths, or a JSONL prompt file."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np


class WorkloadError(ValueError):
    """A workload that cannot be built (bad file, bad lengths); the message is one line."""


@dataclass(frozen=True)
class BenchRequest:
    """One prompt to send: token ids (random workload) or text (dataset), and how many tokens to ask for.
    prompt_tokens is the client's count (len(token_ids)); 0 for text, which the server counts.
    achievable_cached: of the prompt, tokens a prefix cache could serve (the shared prefix of a prefix already
    sent, a conversation's resent history; bench/prefix_workloads.py); turn: a conversation's turn, from 1
    (0: not a conversation)."""

    output_len: int
    ignore_eos: bool
    token_ids: tuple[int, ...] = ()
    text: str = ""
    achievable_cached: int = 0
    turn: int = 0

    def __post_init__(self) -> None:
        if bool(self.token_ids) == bool(self.text):
            raise WorkloadError("a request needs exactly one of token_ids or text")
        if self.output_len <= 0:
            raise WorkloadError(f"output length must be positive, got {self.output_len}")

    @property
    def prompt_tokens(self) -> int:
        return len(self.token_ids)


def sample_lengths(rng: np.random.Generator, length: int, range_ratio: float, count: int) -> np.ndarray:
    """count lengths uniform over the integers in [max(int(length * range_ratio), 1), length]."""
    if length <= 0:
        raise WorkloadError(f"length must be positive, got {length}")
    if not 0.0 <= range_ratio <= 1.0:
        raise WorkloadError(f"range ratio must be in [0, 1], got {range_ratio}")
    low = max(int(length * range_ratio), 1)
    return rng.integers(low, length + 1, size=count)


def usable_tokens(vocab_size: int, special_ids: frozenset[int]) -> np.ndarray:
    """The vocabulary minus special ids (random prompts draw from these)."""
    allowed = np.setdiff1d(np.arange(vocab_size, dtype=np.int64), np.fromiter(special_ids, dtype=np.int64))
    if allowed.size == 0:
        raise WorkloadError(f"no usable token ids: vocab size {vocab_size}, {len(special_ids)} special ids")
    return allowed


def random_requests(
    count: int,
    input_len: int,
    output_len: int,
    vocab_size: int,
    special_ids: frozenset[int] = frozenset(),
    range_ratio: float = 1.0,
    seed: int = 0,
    ignore_eos: bool = True,
) -> list[BenchRequest]:
    """Random prompts over the vocabulary minus special ids; the same seed gives the same list."""
    allowed = usable_tokens(vocab_size, special_ids)
    rng = np.random.default_rng(seed)
    input_lens = sample_lengths(rng, input_len, range_ratio, count)
    output_lens = sample_lengths(rng, output_len, range_ratio, count)
    return [
        BenchRequest(
            output_len=int(out_len),
            ignore_eos=ignore_eos,
            token_ids=tuple(int(token) for token in rng.choice(allowed, size=int(in_len))),
        )
        for in_len, out_len in zip(input_lens, output_lens)
    ]


def dataset_requests(path: Path, count: int, default_output_len: int, ignore_eos: bool) -> list[BenchRequest]:
    """Lines {"prompt": text, "output_len": n} ("output_len" optional: default_output_len), in file order,
    repeated from the top when count exceeds the number of lines. Blank lines are skipped."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as error:
        raise WorkloadError(f"cannot read dataset {path}: {error.strerror or error}") from None
    prompts: list[BenchRequest] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as error:
            raise WorkloadError(f"{path}:{number}: not valid JSON ({error.msg})") from None
        if not isinstance(item, dict) or not isinstance(item.get("prompt"), str) or not item["prompt"]:
            raise WorkloadError(f'{path}:{number}: expected an object with a non-empty string "prompt"')
        output_len = item.get("output_len", default_output_len)
        if isinstance(output_len, bool) or not isinstance(output_len, int) or output_len <= 0:
            raise WorkloadError(f'{path}:{number}: "output_len" must be a positive integer, got {output_len!r}')
        prompts.append(BenchRequest(output_len=output_len, ignore_eos=ignore_eos, text=item["prompt"]))
    if not prompts:
        raise WorkloadError(f"dataset {path} has no prompts")
    return [prompts[index % len(prompts)] for index in range(count)]
