"""Workloads that a prefix cache can serve (`pdserve bench --workload shared-prefix | multi-turn`), and what each
request could at best take from the cache (BenchRequest.achievable_cached: the hit rate's denominator).

shared-prefix: num_prefixes random prefixes of prefix_min_len..prefix_len tokens; request i takes prefix
i % num_prefixes (round robin, so requests of one prefix are interleaved with the others') and a random suffix
of suffix_len * range_ratio..suffix_len tokens. Achievable: the prefix's length for every request after the
first of its prefix (the first computes it), 0 for the first.

multi-turn (the turns are built while the run goes, bench/conversations.py): conversation c's turn t sends the
whole history - its system prompt (system_len random tokens of its own; none by default), every earlier user
message and the model's actual answers - plus a new user message of message_len * range_ratio..message_len
tokens. Achievable: the history's length (every token of it was sent or generated before); 0 for the first turn
(its system prompt is new)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from bench.workload import BenchRequest, WorkloadError, sample_lengths

WORKLOADS = ("random", "shared-prefix", "multi-turn")


@dataclass(frozen=True)
class SharedPrefixShape:
    num_prefixes: int = 4
    prefix_min_len: int = 1024
    prefix_len: int = 4096
    suffix_len: int = 32

    def __post_init__(self) -> None:
        if self.num_prefixes <= 0:
            raise ValueError(f"--num-prefixes must be positive, got {self.num_prefixes}")
        if not 0 < self.prefix_min_len <= self.prefix_len:
            raise ValueError(f"--prefix-min-len must be in 1..--prefix-len ({self.prefix_len}), got {self.prefix_min_len}")
        if self.suffix_len <= 0:
            raise ValueError(f"--suffix-len must be positive, got {self.suffix_len}")


@dataclass(frozen=True)
class ConversationShape:
    """conversations interleaved, each of `turns` turns; think_time_s between a turn's answer and the next turn;
    system_len: tokens of each conversation's system prompt (its first turn's start)."""

    conversations: int = 8
    turns: int = 4
    think_time_s: float = 0.1
    system_len: int = 0

    def __post_init__(self) -> None:
        if self.conversations <= 0:
            raise ValueError(f"--conversations must be positive, got {self.conversations}")
        if self.turns <= 0:
            raise ValueError(f"--turns must be positive, got {self.turns}")
        if not 0.0 <= self.think_time_s < float("inf"):
            raise ValueError(f"--think-time must be >= 0 seconds, got {self.think_time_s}")
        if self.system_len < 0:
            raise ValueError(f"--system-prompt-len must be >= 0, got {self.system_len}")

    @property
    def num_requests(self) -> int:
        return self.conversations * self.turns


def shared_prefix_requests(count: int, shape: SharedPrefixShape, output_len: int, allowed: np.ndarray,
                           range_ratio: float = 1.0, seed: int = 0, ignore_eos: bool = True) -> list[BenchRequest]:
    """count requests over shape.num_prefixes prefixes (round robin); the same seed gives the same list."""
    if count <= 0:
        raise WorkloadError(f"the request count must be positive, got {count}")
    rng = np.random.default_rng(seed)
    prefix_lens = rng.integers(shape.prefix_min_len, shape.prefix_len + 1, size=shape.num_prefixes)
    prefixes = [tuple(int(token) for token in rng.choice(allowed, size=int(length))) for length in prefix_lens]
    suffix_lens = sample_lengths(rng, shape.suffix_len, range_ratio, count)
    output_lens = sample_lengths(rng, output_len, range_ratio, count)
    requests = []
    for index, (suffix_len, out_len) in enumerate(zip(suffix_lens, output_lens)):
        prefix = prefixes[index % shape.num_prefixes]
        suffix = tuple(int(token) for token in rng.choice(allowed, size=int(suffix_len)))
        achievable = len(prefix) if index >= shape.num_prefixes else 0
        requests.append(BenchRequest(output_len=int(out_len), ignore_eos=ignore_eos, token_ids=prefix + suffix,
                                     achievable_cached=achievable))
    return requests


class ConversationScript:
    """The random parts of every conversation, drawn up front from the seed: each turn's new user message and
    answer length (the answers themselves come from the model)."""

    def __init__(self, shape: ConversationShape, message_len: int, output_len: int, allowed: np.ndarray,
                 range_ratio: float = 1.0, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        count = shape.num_requests
        message_lens = sample_lengths(rng, message_len, range_ratio, count)
        output_lens = sample_lengths(rng, output_len, range_ratio, count)
        self.shape = shape
        self.messages = [tuple(int(token) for token in rng.choice(allowed, size=int(length))) for length in message_lens]
        self.output_lens = [int(length) for length in output_lens]
        self.systems = [tuple(int(token) for token in rng.choice(allowed, size=shape.system_len))
                        for _ in range(shape.conversations)]

    def turn(self, conversation: int, turn: int, history: tuple[int, ...], ignore_eos: bool) -> BenchRequest:
        """Turn `turn` (from 1) of `conversation`: the history (the system prompt, earlier turns' new messages and
        the answers, in order; the first turn's is the system prompt) plus this turn's new message; achievable: the
        history's length after the first turn."""
        index = conversation * self.shape.turns + turn - 1
        if turn == 1:
            history = self.systems[conversation]
        return BenchRequest(output_len=self.output_lens[index], ignore_eos=ignore_eos,
                            token_ids=history + self.messages[index],
                            achievable_cached=len(history) if turn > 1 else 0, turn=turn)
