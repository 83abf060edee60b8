"""What one benchmark request produced: the per-request record every metric is computed from."""
from __future__ import annotations

from dataclasses import dataclass, field

from bench.workload import BenchRequest


@dataclass
class RequestRecord:
    """Timings of one streamed request, in seconds since the request was sent.

    ttft_s: arrival of the first chunk that carried at least one token.
    itl_s: inter-token latencies; a chunk with n tokens arriving g seconds after the previous
      token-carrying chunk contributes n entries of g / n (tokens that share the first chunk with
      the first token add none). So sum(itl_s) == last token time - ttft_s.
    e2e_s: until the stream ended (Complete received).
    prompt_tokens: the server's count when it reported one, else the client's.
    output_tokens: tokens actually streamed back.
    accept_length: the server's mean accepted tokens per verify step (None when not reported).
    cached_tokens: of the prompt, tokens the server's prefix cache served (its usage report; 0 when none).
    achievable_cached_tokens / turn: the request's (BenchRequest.achievable_cached / turn).
    output_token_ids: the streamed tokens (gRPC; empty over HTTP, which streams text): a conversation's answer.
    error: empty when the request completed.
    """

    prompt_tokens: int
    expected_output_tokens: int
    output_tokens: int = 0
    ttft_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float = 0.0
    start_s: float = 0.0
    accept_length: float | None = None
    cached_tokens: int = 0
    achievable_cached_tokens: int = 0
    turn: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    error: str = ""

    @classmethod
    def of(cls, request: BenchRequest) -> RequestRecord:
        """The record of a request about to be sent (the client's counts until the server reports its own)."""
        return cls(prompt_tokens=request.prompt_tokens, expected_output_tokens=request.output_len,
                   achievable_cached_tokens=request.achievable_cached, turn=request.turn)

    @property
    def success(self) -> bool:
        return not self.error

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (e2e - ttft) / (output_tokens - 1); None for < 2 tokens."""
        if not self.success or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def end_stream(self, chunk_times_s: list[float], chunk_tokens: list[int], last_message: str) -> None:
        """After the stream: itl_s from the chunks (spread_chunk_gaps), and the error of a stream that ended
        without `last_message` (its finish reason) or without a single token, unless one is already set."""
        self.itl_s = spread_chunk_gaps(chunk_times_s, chunk_tokens)
        if not self.error and not self.finish_reason:
            self.error = f"stream ended without {last_message}"
        if not self.error and self.output_tokens == 0:
            self.error = "completed without producing a token"


def spread_chunk_gaps(chunk_times_s: list[float], chunk_tokens: list[int]) -> list[float]:
    """ITL list from chunk arrival times (seconds since send) and their token counts.

    Chunks with zero tokens (text-only flushes) are skipped. The first token-carrying chunk is the
    first token; each later chunk with n tokens, arriving g after the previous token-carrying chunk,
    contributes n intervals of g / n.
    """
    if len(chunk_times_s) != len(chunk_tokens):
        raise ValueError("chunk_times_s and chunk_tokens must have the same length")
    itl: list[float] = []
    previous: float | None = None
    for arrival, count in zip(chunk_times_s, chunk_tokens):
        if count <= 0:
            continue
        if previous is not None:
            itl.extend([(arrival - previous) / count] * count)
        previous = arrival
    return itl
