"""How many prompt tokens the prefill worker takes into one engine step.

A batch's prompts all get their first token when the whole batch is done, and the decode worker has nothing
to decode for them until then. On a GPU a 2048-token batch takes tens of milliseconds, and bigger batches
use the device better; on a CPU it can take a second (16 Kimi K3 prompts of 128 tokens), long enough to
make a closed loop of requests run in waves: the decode worker idles while the prefill worker runs the
wave, and the other way round. So a batch is capped at the tokens the engine has been prefilling in
`target_ms` (measured: wall milliseconds per prompt token, smoothed), and at `batch_tokens` in any case;
it always takes at least one prompt."""
from __future__ import annotations

from dataclasses import dataclass

DEFAULT_BATCH_TARGET_MS = 100.0  # a prefill batch's wall time to aim below
SMOOTHING = 0.5  # weight of the newest batch in the running milliseconds-per-token estimate


def batch_token_limit(batch_tokens: int, target_ms: float, ms_per_token: float | None) -> int:
    """Prompt tokens to take into the next batch: batch_tokens, lowered to what fits target_ms at the measured
    cost (target_ms <= 0, or no measurement yet: batch_tokens)."""
    if target_ms <= 0 or ms_per_token is None or ms_per_token <= 0:
        return batch_tokens
    return max(1, min(batch_tokens, int(target_ms / ms_per_token)))


@dataclass
class PrefillCost:
    """The engine's recent prefill cost, wall milliseconds per prompt token (None until a batch ran)."""

    ms_per_token: float | None = None

    def observe(self, batch_ms: float, num_tokens: int) -> None:
        if num_tokens <= 0 or batch_ms < 0:
            return
        latest = batch_ms / num_tokens
        old = self.ms_per_token
        self.ms_per_token = latest if old is None else SMOOTHING * latest + (1 - SMOOTHING) * old
