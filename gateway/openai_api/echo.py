"""What one choice shows of its run's token events when the prompt is echoed or scored: with `echo` the
prompt's text comes first (and, with logprobs, its tokens: the first without a logprob, as OpenAI sends it,
the others scored by the prefill); with max_tokens 0 (prompt scoring only: the engine still makes one
token, which is dropped here) nothing generated is shown. vLLM's `prompt_logprobs` field is formatted
here too."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from gateway.openai_api.json_types import JsonObject
from gateway.openai_api.responses import TokenLogprobLike


@dataclass(frozen=True)
class Unscored:
    """The prompt's first token in an echoed logprobs block: no logprob, no alternatives (null in JSON)."""

    token_id: int
    logprob: None = None
    top: None = None


@dataclass
class ChoiceView:
    """echo_text: the prompt's text to put first (None: no echo); prompt_ids: the prompt's tokens; with_logprobs:
    the answer carries logprobs; keep_completion: False when max_tokens was 0."""

    echo_text: str | None
    prompt_ids: Sequence[int]
    with_logprobs: bool
    keep_completion: bool = True
    _started: bool = field(default=False, init=False)

    def take(self, text: str, logprobs: Sequence[TokenLogprobLike],
             prompt_logprobs: Sequence[TokenLogprobLike]) -> tuple[str, list[TokenLogprobLike]]:
        """One token event's (text, logprobs) as the choice shows them."""
        first, self._started = not self._started, True
        shown_text = text if self.keep_completion else ""
        shown = list(logprobs) if self.keep_completion else []
        if first and self.echo_text is not None:
            shown_text = self.echo_text + shown_text
            if self.with_logprobs:
                shown = [Unscored(self.prompt_ids[0]), *prompt_logprobs, *shown]
        return shown_text, shown

    def completion_tokens(self, generated: int) -> int:
        return generated if self.keep_completion else 0


def prompt_logprobs_field(prompt_ids: Sequence[int], prompt_logprobs: Sequence[TokenLogprobLike], count: int,
                          token_text: Callable[[int], str]) -> list[dict[str, JsonObject] | None]:
    """vLLM's prompt_logprobs: None for the first prompt token, then per token {token id (a string): {logprob,
    rank, decoded_token}} holding the prompt token and its `count` most likely alternatives (rank: 1-based
    place among them; the prompt token's rank is null when it is not among them)."""
    entries: list[dict[str, JsonObject] | None] = [None]
    for item in prompt_logprobs:
        alternatives = list(item.top)[:count]
        entry = {str(top.token_id): {"logprob": top.logprob, "rank": rank, "decoded_token": token_text(top.token_id)}
                 for rank, top in enumerate(alternatives, start=1)}
        if str(item.token_id) not in entry:
            entry[str(item.token_id)] = {"logprob": item.logprob, "rank": None, "decoded_token": token_text(item.token_id)}
        entries.append(entry)
    return entries[: len(prompt_ids)]
