"""A step's results as the host sees them: sampled token ids and their logprobs. Pure functions of
logits, parameters and generators (the engine and the prefill-service entry both use them)."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.runtime.devices import host_to_device
from engine.runtime.host_fetch import fetch_to_host
from engine.sampling.ops import SamplingBatch, top_logprobs
from engine.sampling_params import SamplingParams
from engine.runtime.sequence import TokenLogprob


def sample_on_device(params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None],
                     logits: torch.Tensor) -> torch.Tensor:
    """logits [n, vocab] -> token ids [n] int64 on the logits' device (nothing fetched)."""
    return SamplingBatch.from_params(list(params), list(generators), device=logits.device).sample(logits)


def sample_tokens(params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None],
                  logits: torch.Tensor) -> list[int]:
    """sample_on_device and its fetch to the host."""
    return fetch_to_host(sample_on_device(params, generators, logits))


def token_logprobs(logits: torch.Tensor, tokens: list[int], num_top: int) -> list[TokenLogprob]:
    """logits [len(tokens), vocab], row i the one that produced tokens[i] -> each token's logprob and the
    num_top most likely alternatives (one device-to-host copy)."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    values, ids = top_logprobs(logits, max(num_top, 1))
    chosen = log_probs.gather(1, host_to_device(tokens, torch.int64, logits.device).unsqueeze(1))
    rows = fetch_to_host(torch.cat([chosen.double(), values[:, :num_top].double(), ids[:, :num_top].double()], dim=1))
    return [TokenLogprob(token, row[0], [int(v) for v in row[1 + num_top :]], row[1 : 1 + num_top])
            for token, row in zip(tokens, rows)]
