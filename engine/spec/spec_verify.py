"""Verification of speculative drafts that keeps the target distribution exactly.

Sequence i brings k_i >= 0 draft tokens d_0 .. d_{k_i - 1} and k_i + 1 target rows (row j is the
target's distribution for the token after d_{j-1}; row 0 follows the last committed token).
Batches may mix different k_i. Inputs are accepted in three layouts:
  per-sequence lists ([k_i] / [k_i, V] / [k_i + 1, V] tensors),
  padded tensors ([S, K] / [S, K, V] / [S, K + 1, V] with num_drafts giving each k_i),
  packed 2-D rows ([sum k_i, V] / [sum (k_i + 1), V], sequences back to back, as a ragged
  model forward produces them).

Greedy: accept the longest prefix of drafts equal to the target argmax, then emit the target's
argmax at the first mismatch (or after the last draft) - 1 .. k_i + 1 tokens.
Sampled: accept d_j with probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection emit a
draw from norm(max(0, p_j - q_j)) and stop; if every draft is accepted emit a draw from p_{k_i}.
A greedy (deterministic) draft is covered by passing one-hot q rows; a greedy request in a sampled
batch (one-hot p and q rows) gets exactly verify_greedy's result, so mixed batches can go through
verify_sampled alone. Both verifiers return VerifyTensors (on the device); .per_sequence() lists the tokens.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Union

import torch

from engine.runtime.devices import host_to_device
from engine.sampling.ops import Generators, exponential_noise, fill_exponential_, sample_with_noise

Rows = Union[torch.Tensor, Sequence[torch.Tensor]]


class VerifyResult(NamedTuple):
    """Tokens to append for one sequence (accepted drafts, then one target token)."""

    tokens: list[int]
    num_accepted_drafts: int


def _draft_lengths(draft_tokens: Rows, num_drafts: Sequence[int] | torch.Tensor | None) -> list[int]:
    if num_drafts is not None:
        return [int(n) for n in num_drafts]
    if isinstance(draft_tokens, torch.Tensor):
        if draft_tokens.dim() != 2:
            raise ValueError("packed 1-D draft tokens need num_drafts")
        return [draft_tokens.shape[1]] * draft_tokens.shape[0]
    return [int(tokens.shape[0]) for tokens in draft_tokens]


def _pad(rows: Rows, lengths: list[int], width: int) -> torch.Tensor:
    """rows (list of [len_i, ...], packed [sum len_i, ...] or already padded [S, >= width, ...])
    -> [S, width, ...] with zeros beyond len_i."""
    if isinstance(rows, torch.Tensor) and rows.dim() == (3 if rows.is_floating_point() else 2):
        if rows.shape[0] != len(lengths) or rows.shape[1] < width:
            raise ValueError(f"padded rows {tuple(rows.shape)} do not fit {len(lengths)} sequences of <= {width}")
        return rows[:, :width]
    pieces = list(rows) if not isinstance(rows, torch.Tensor) else list(torch.split(rows, lengths))
    if len(pieces) != len(lengths):
        raise ValueError(f"{len(pieces)} sequences of rows for {len(lengths)} sequences")
    first = pieces[0]
    out = first.new_zeros((len(lengths), width, *first.shape[1:]))
    for index, (piece, length) in enumerate(zip(pieces, lengths)):
        if piece.shape[0] != length:
            raise ValueError(f"sequence {index}: expected {length} rows, got {piece.shape[0]}")
        out[index, :length] = piece
    return out


class VerifyTensors(NamedTuple):
    """A verify step's outcome, still on the device: drafts [S, K] (padded), num_accepted [S], final [S]."""

    drafts: torch.Tensor
    num_accepted: torch.Tensor
    final_tokens: torch.Tensor

    def per_sequence(self) -> list[VerifyResult]:
        """The tokens each sequence appends (one host copy of each tensor)."""
        drafts, accepted, finals = self.drafts.tolist(), self.num_accepted.tolist(), self.final_tokens.tolist()
        return [VerifyResult(row[:n] + [final], n) for row, n, final in zip(drafts, accepted, finals)]


def _no_sequences() -> VerifyTensors:
    empty = torch.zeros(0, dtype=torch.long)
    return VerifyTensors(empty.view(0, 0), empty, empty)


def _accepted_prefix(accept: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """accept: [S, K] bool, lengths: [S] -> [S] int64 length of the all-accepted prefix within k_i."""
    valid = torch.arange(accept.shape[1], device=accept.device).unsqueeze(0) < lengths.unsqueeze(1)
    return (accept & valid).long().cumprod(dim=1).sum(dim=1)


def verify_greedy(
    draft_tokens: Rows, target_logits: Rows, num_drafts: Sequence[int] | torch.Tensor | None = None
) -> VerifyTensors:
    """draft_tokens: per sequence [k_i] int (list, padded [S, K] or packed [sum k_i]);
    target_logits: per sequence [k_i + 1, V] (list, padded [S, K + 1, V] or packed [sum(k_i+1), V]).
    Per sequence the accepted drafts and the target's argmax after them (lowest index on ties)."""
    lengths = _draft_lengths(draft_tokens, num_drafts)
    if not lengths:
        return _no_sequences()
    width = max(lengths)
    target = _pad(target_logits, [n + 1 for n in lengths], width + 1).argmax(dim=-1)
    drafts = _pad(draft_tokens, lengths, width).long().to(target.device)
    num_accepted = _accepted_prefix(drafts == target[:, :width], host_to_device(lengths, torch.int64, drafts.device))
    return VerifyTensors(drafts, num_accepted, target.gather(1, num_accepted.unsqueeze(1)).squeeze(1))


def rejection_sample(
    draft_tokens: torch.Tensor,
    num_drafts: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    uniform: torch.Tensor,
    noise: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The deterministic core of sampled verification, vectorised over S sequences (or trials).

    draft_tokens: [S, K] int64; num_drafts: [S] (k_i <= K; entries beyond k_i ignored);
    draft_probs q: [S, K, V]; target_probs p: [S, K + 1, V]; uniform: [S, K] U[0, 1);
    noise: [S, V] Exp(1) for the one categorical draw each sequence makes.
    Returns (num_accepted [S] int64, final_token [S] int64). d_j is accepted iff u_j * q(d_j) <
    p(d_j), i.e. with probability min(1, p/q); p(d_j) = 0 is always rejected (q(d_j) = 0 cannot
    happen for a draft sampled from q; it would be accepted whenever p(d_j) > 0). Tokens with
    q = 0 < p are reached through the residual max(0, p - q)."""
    num_seqs, width = draft_tokens.shape
    drafts = draft_tokens.long()
    p_draft = target_probs[:, :width].gather(2, drafts.unsqueeze(2)).squeeze(2)
    q_draft = draft_probs.gather(2, drafts.unsqueeze(2)).squeeze(2)
    num_accepted = _accepted_prefix(uniform * q_draft < p_draft, num_drafts.to(drafts.device))
    rows = torch.arange(num_seqs, device=drafts.device)
    p_stop = target_probs[rows, num_accepted]
    # At position k_i there is no draft: q is taken as 0, so the residual is p itself (the bonus).
    if width == 0:
        q_stop = torch.zeros_like(p_stop)
    else:
        rejected = (num_accepted < num_drafts.to(drafts.device)).unsqueeze(1)
        q_stop = draft_probs[rows, num_accepted.clamp_max(width - 1)] * rejected
    residual = (p_stop - q_stop).clamp_min(0.0)
    # A residual of zero mass only arises from rounding when p == q; fall back to p.
    empty = residual.sum(dim=1, keepdim=True) <= 0
    return num_accepted, sample_with_noise(torch.where(empty, p_stop, residual), noise)


def draw_verify_randomness(
    num_drafts: Sequence[int], vocab_size: int, device: torch.device, generators: Generators
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (uniform [S, max k] , noise [S, V]). With a sequence of generators, sequence i draws
    k_i uniforms then V exponentials from generators[i] (so its result is reproducible whatever
    else is in the batch)."""
    width = max(num_drafts)
    uniform = torch.zeros((len(num_drafts), width), device=device)
    if generators is None or isinstance(generators, torch.Generator):
        uniform.uniform_(generator=generators)
        return uniform, exponential_noise((len(num_drafts), vocab_size), device, generators)
    if len(generators) != len(num_drafts):
        raise ValueError(f"{len(generators)} generators for {len(num_drafts)} sequences")
    noise = torch.empty((len(num_drafts), vocab_size), device=device)
    for index, (gen, length) in enumerate(zip(generators, num_drafts)):
        uniform[index, :length].uniform_(generator=gen)
        fill_exponential_(noise[index], gen)
    return uniform, noise


def verify_sampled(
    draft_tokens: Rows,
    draft_probs: Rows,
    target_probs: Rows,
    generators: Generators = None,
    num_drafts: Sequence[int] | torch.Tensor | None = None,
) -> VerifyTensors:
    """draft_tokens: per sequence [k_i]; draft_probs q: per sequence [k_i, V], the distribution
    each draft was sampled from (after the request's temperature / top-k / top-p / min-p);
    target_probs p: per sequence [k_i + 1, V] after the same settings. Layouts as the module
    docstring. generators: per sequence (the request's generator; None entries use the default
    RNG), one for the whole batch, or None. Emitted tokens are distributed exactly as sampling
    the target autoregressively."""
    lengths = _draft_lengths(draft_tokens, num_drafts)
    if not lengths:
        return _no_sequences()
    width = max(lengths)
    target = _pad(target_probs, [n + 1 for n in lengths], width + 1).float()
    if width == 0:
        drafts = torch.zeros((len(lengths), 0), dtype=torch.long, device=target.device)
        q = target.new_zeros((len(lengths), 0, target.shape[-1]))
    else:
        drafts = _pad(draft_tokens, lengths, width).long().to(target.device)
        q = _pad(draft_probs, lengths, width).float().to(target.device)
    uniform, noise = draw_verify_randomness(lengths, target.shape[-1], target.device, generators)
    num_accepted, final = rejection_sample(drafts, host_to_device(lengths, torch.int64, target.device), q, target,
                                           uniform, noise)
    return VerifyTensors(drafts, num_accepted, final)


@dataclass
class AcceptanceStats:
    """Running acceptance counters over verify steps (one step = one sequence verified once).

    position_attempted[j]: steps in which draft position j was verified (it existed and every
    earlier draft was accepted); position_accepted[j]: steps in which it was accepted. So
    per_position_acceptance[j] is the acceptance rate of position j given it was reached."""

    num_verify_steps: int = 0
    num_drafts: int = 0
    num_accepted_drafts: int = 0
    position_attempted: list[int] = field(default_factory=list)
    position_accepted: list[int] = field(default_factory=list)

    def record(self, result: VerifyResult, num_drafts: int) -> None:
        """Add one verify step of a sequence that brought num_drafts drafts."""
        accepted = result.num_accepted_drafts
        if not 0 <= accepted <= num_drafts:
            raise ValueError(f"{accepted} accepted drafts out of {num_drafts}")
        reached = min(accepted + 1, num_drafts)
        self._grow(reached)
        for position in range(reached):
            self.position_attempted[position] += 1
        for position in range(accepted):
            self.position_accepted[position] += 1
        self.num_verify_steps += 1
        self.num_drafts += num_drafts
        self.num_accepted_drafts += accepted

    def record_all(self, results: Sequence[VerifyResult], num_drafts: Sequence[int]) -> None:
        """Add one verify step for each (result, num_drafts) pair."""
        if len(results) != len(num_drafts):
            raise ValueError(f"{len(results)} results for {len(num_drafts)} draft counts")
        for result, count in zip(results, num_drafts):
            self.record(result, int(count))

    def _grow(self, length: int) -> None:
        missing = length - len(self.position_attempted)
        if missing > 0:
            self.position_attempted.extend([0] * missing)
            self.position_accepted.extend([0] * missing)

    def merge(self, other: AcceptanceStats) -> AcceptanceStats:
        """A new AcceptanceStats holding both sets of counts (e.g. across decode workers)."""
        width = max(len(self.position_attempted), len(other.position_attempted))

        def padded(values: list[int]) -> list[int]:
            return values + [0] * (width - len(values))

        return AcceptanceStats(
            num_verify_steps=self.num_verify_steps + other.num_verify_steps,
            num_drafts=self.num_drafts + other.num_drafts,
            num_accepted_drafts=self.num_accepted_drafts + other.num_accepted_drafts,
            position_attempted=[a + b for a, b in zip(padded(self.position_attempted), padded(other.position_attempted))],
            position_accepted=[a + b for a, b in zip(padded(self.position_accepted), padded(other.position_accepted))],
        )

    @property
    def mean_accepted_tokens(self) -> float:
        """Tokens emitted per verify step, the bonus token included (0.0 before any step)."""
        return (self.num_accepted_drafts + self.num_verify_steps) / self.num_verify_steps if self.num_verify_steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts / proposed drafts (0.0 before any draft)."""
        return self.num_accepted_drafts / self.num_drafts if self.num_drafts else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        """[j] = accepted / attempted at draft position j."""
        return [acc / att if att else 0.0 for acc, att in zip(self.position_accepted, self.position_attempted)]

    def to_dict(self) -> dict[str, object]:
        return {
            "num_verify_steps": self.num_verify_steps,
            "num_drafts": self.num_drafts,
            "num_accepted_drafts": self.num_accepted_drafts,
            "mean_accepted_tokens": self.mean_accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "per_position_acceptance": self.per_position_acceptance,
            "position_attempted": list(self.position_attempted),
            "position_accepted": list(self.position_accepted),
        }
