"""DSpark's Markov logit-bias heads and confidence head (K3_SPEC 5.2).

Drafts are formed left to right: slot k's logits are base_k + bias_k, where bias_k depends on the token
chosen at slot k-1 (prev_0 = the bonus token) and, for the gated and rnn kinds, on the draft's hidden state
h_k of slot k (the final-normed hidden the base logits come from). With E = markov_w1 (an embedding of rank
r) and W2 = markov_w2 (a linear r -> vocab, no bias):

  vanilla  bias_k = W2 E[prev_k]
  gated    bias_k = W2 (sigmoid(gate_proj [h_k ; E[prev_k]]) * E[prev_k])        gate_proj: H + r -> r
  rnn      z = joint_proj [s_k ; E[prev_k] ; h_k] = (a | c | o)                    joint_proj: 2r + H -> 3r
           s_{k+1} = sigmoid(a) * s_k + (1 - sigmoid(a)) * tanh(c),  s_0 = 0;  bias_k = W2 tanh(o)

A head's `steps(hidden)` returns a MarkovSteps for one proposal: called once per slot, in order, with the
previous tokens, it returns that slot's bias (and carries the rnn state).
Confidence head (optional): c_k = sigmoid(proj [h_k ; E[prev_k]]), float32.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from engine.kernels import cpu_linear, cpu_native

MARKOV_KINDS = ("vanilla", "gated", "rnn")


class MarkovHead(nn.Module):
    """The vanilla rank-r head (the gated and rnn kinds extend it)."""

    kind = "vanilla"
    needs_hidden = False

    def __init__(self, vocab_size: int, rank: int) -> None:
        super().__init__()
        self.rank = rank
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)

    def step_bias(self, prev: Tensor, hidden: Tensor | None, state: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """prev [n] ids, hidden [n, H] (slot k) or None, state [n, r] or None -> (bias [n, vocab] float32, state)."""
        return self.markov_w2(self.markov_w1(prev)).float(), state

    def steps(self, hidden: Tensor | None = None) -> MarkovSteps:
        """hidden: [n, slots, H] for the kinds that read it (needs_hidden), else None."""
        if self.needs_hidden and hidden is None:
            raise ValueError(f"the {self.kind} Markov head needs the draft's hidden states")
        return MarkovSteps(self, hidden)

    def forward(self, prev: Tensor) -> Tensor:
        """The vanilla bias alone: prev [n] -> [n, vocab] float32."""
        return MarkovHead.step_bias(self, prev, None, None)[0]

    def greedy_drafts(self, base: Tensor, last: Tensor) -> Tensor | None:
        """The greedy chain in one call: base [n, slots, V] float32 logits, last [n] int64 (prev_0) -> tokens
        [n, slots] int64, through engine/kernels/cpu_native.py on the CPU for the vanilla head (W2 read from the
        row-major transposed copy cpu_linear keeps); None where that does not apply (the caller goes slot by
        slot). The rows round differently from addmm's (drafts only: verification never depends on that)."""
        if self.kind != "vanilla" or base.device.type != "cpu":
            return None
        w2t = cpu_linear.transposed_weight(self.markov_w2.weight)
        if w2t is None:  # past the cap on held copies
            return None
        return cpu_native.markov_greedy(base, last, self.markov_w1.weight.detach(), w2t)


class GatedMarkovHead(MarkovHead):
    kind = "gated"
    needs_hidden = True

    def __init__(self, vocab_size: int, rank: int, hidden_size: int) -> None:
        super().__init__(vocab_size, rank)
        self.gate_proj = nn.Linear(hidden_size + rank, rank)

    def step_bias(self, prev: Tensor, hidden: Tensor | None, state: Tensor | None) -> tuple[Tensor, Tensor | None]:
        embedded = self.markov_w1(prev)
        gate = torch.sigmoid(self.gate_proj(torch.cat((hidden.to(embedded.dtype), embedded), dim=-1)))
        return self.markov_w2(gate * embedded).float(), state


class RnnMarkovHead(MarkovHead):
    kind = "rnn"
    needs_hidden = True

    def __init__(self, vocab_size: int, rank: int, hidden_size: int) -> None:
        super().__init__(vocab_size, rank)
        self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)

    def step_bias(self, prev: Tensor, hidden: Tensor | None, state: Tensor | None) -> tuple[Tensor, Tensor | None]:
        embedded = self.markov_w1(prev)
        if state is None:
            state = torch.zeros_like(embedded)
        a, c, o = self.joint_proj(torch.cat((state, embedded, hidden.to(embedded.dtype)), dim=-1)).chunk(3, dim=-1)
        keep = torch.sigmoid(a)
        return self.markov_w2(torch.tanh(o)).float(), keep * state + (1.0 - keep) * torch.tanh(c)


class MarkovSteps:
    """One proposal's left-to-right bias: call with the previous tokens of slot 0, 1, ... in order."""

    def __init__(self, head: MarkovHead, hidden: Tensor | None) -> None:
        self.head, self.hidden, self.slot, self.state = head, hidden, 0, None

    def __call__(self, prev: Tensor) -> Tensor:
        hidden = None if self.hidden is None else self.hidden[:, self.slot]
        bias, self.state = self.head.step_bias(prev, hidden, self.state)
        self.slot += 1
        return bias

    def corrected(self, base: Tensor, prev: Tensor) -> Tensor:
        """base [n, V] float32 + this slot's bias [:, :V]: the vanilla head (W2 as wide as V) as one addmm
        (the draft's rows may round differently from base + bias; verification never depends on that),
        the other kinds through __call__."""
        w2 = self.head.markov_w2.weight  # [vocab, r]
        if self.head.kind != "vanilla" or w2.shape[0] != base.shape[-1] or w2.dtype != torch.float32:
            return base + self(prev)[:, : base.shape[-1]]
        self.slot += 1
        return torch.addmm(base, self.head.markov_w1(prev), w2.t())


def build_markov_head(kind: str, vocab_size: int, rank: int, hidden_size: int) -> MarkovHead:
    if kind == "vanilla":
        return MarkovHead(vocab_size, rank)
    if kind == "gated":
        return GatedMarkovHead(vocab_size, rank, hidden_size)
    if kind == "rnn":
        return RnnMarkovHead(vocab_size, rank, hidden_size)
    raise ValueError(f"markov_head_type {kind!r} is not supported (supported: {MARKOV_KINDS})")


class ConfidenceHead(nn.Module):
    def __init__(self, hidden_size: int, rank: int) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden_size + rank, 1, dtype=torch.float32)
