"""Per-request sampling settings, validated once at construction."""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field


# structured_output kinds: a JSON schema (JSON text), any JSON object, a regex, a Lark grammar (llguidance's
# syntax), a JSON list of strings to choose from
GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)


def _logit_bias(value: object) -> tuple[tuple[int, float], ...]:
    """A dict or pairs -> sorted (token id, bias) pairs, each id >= 0 once, each bias in [-100, 100]."""
    try:
        pairs = sorted((value.items() if isinstance(value, dict) else value), key=lambda pair: pair[0])  # type: ignore[union-attr]
        pairs = [(token, bias) for token, bias in pairs]
    except (TypeError, ValueError):
        raise ValueError(f"logit_bias must map token ids to biases, got {value!r}") from None
    for token, bias in pairs:
        if not _is_int(token) or token < 0:
            raise ValueError(f"logit_bias keys must be non-negative token ids, got {token!r}")
        if not _is_real(bias) or not -100.0 <= bias <= 100.0:
            raise ValueError(f"logit_bias values must be in [-100, 100], got {bias!r} for token {token}")
    if len({token for token, _ in pairs}) != len(pairs):
        raise ValueError("logit_bias names a token id twice")
    return tuple((token, float(bias)) for token, bias in pairs)


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy. top_k -1 (or 0) disables top-k; top_p 1.0 disables top-p;
    min_p 0.0 disables min-p. speculative: None follows the engine (on when a draft is loaded).
    block_size: speculative block size (last token + block_size - 1 drafts), None = the engine's
    (the engine also checks it against its own maximum). presence_penalty / frequency_penalty in [-2, 2]
    (0: off), repetition_penalty > 0 (1: off), logit_bias: (token id, bias in [-100, 100]) pairs (a dict is
    accepted; -100 bans the token), min_tokens: eos and stop_token_ids are banned until this many tokens
    were generated (engine/sampling/penalties.py). prompt_logprobs: score the prompt too (each prompt token after the
first, with that many alternatives; None: not asked) from the prefill forward. structured_output: (kind, text),
the grammar every generated token must follow (engine/sampling/grammar.py; kinds GRAMMAR_KINDS; json_object ignores
the text). Every invalid field raises ValueError naming the field."""

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int = 0
    speculative: bool | None = None
    block_size: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    min_tokens: int = 0
    prompt_logprobs: int | None = None
    structured_output: tuple[str, str] | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.max_new_tokens) or self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if not _is_real(self.temperature) or self.temperature < 0 or math.isinf(self.temperature):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 0, got {self.top_k!r}")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or self.seed < 0):
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}")
        try:
            stop_token_ids = tuple(self.stop_token_ids)
        except TypeError:
            raise ValueError(f"stop_token_ids must be a sequence of token ids, got {self.stop_token_ids!r}") from None
        if not all(_is_int(token) and token >= 0 for token in stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if not _is_int(self.logprobs) or not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs!r}")
        if self.speculative is not None and not isinstance(self.speculative, bool):
            raise ValueError(f"speculative must be a bool or None, got {self.speculative!r}")
        if self.block_size is not None and (not _is_int(self.block_size) or self.block_size < 2):
            raise ValueError(f"block_size must be an integer >= 2, got {self.block_size!r}")
        object.__setattr__(self, "stop_token_ids", stop_token_ids)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        if not _is_real(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 100.0:
            raise ValueError(f"repetition_penalty must be in (0, 100], got {self.repetition_penalty!r}")
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_new_tokens:
            raise ValueError(f"min_tokens must be in [0, max_new_tokens], got {self.min_tokens!r}")
        if self.structured_output is not None:
            kind_text = tuple(self.structured_output)
            if len(kind_text) != 2 or kind_text[0] not in GRAMMAR_KINDS or not isinstance(kind_text[1], str):
                raise ValueError(f"structured_output must be (kind, text) with kind one of {', '.join(GRAMMAR_KINDS)}, "
                                 f"got {self.structured_output!r}")
            object.__setattr__(self, "structured_output", kind_text)
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= 20):
            raise ValueError(f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def speculates(params: Sequence[SamplingParams], has_draft: bool) -> bool:
    """Whether a forward over requests with these settings must store the draft model's context (its KV /
    hidden-state entries): only when a draft is loaded and some request may speculate. A request with
    speculative=False never reads its draft context (the engine decides per request, once, from the same
    field), so a batch of such requests skips the writes."""
    return has_draft and any(p.speculative is not False for p in params)
