"""Sampling ops on plain tensors: temperature, top-k / top-p / min-p renormalisation, seeded
draws, greedy argmax, logprobs, and the per-step SamplingBatch the scheduler builds.

The plain-PyTorch ops here are the reference (and the test oracle). Faster renormalisation
kernels (flashinfer on CUDA, aiter on ROCm) plug in through `SamplingKernels`, imported lazily
and only when present; on CPU the torch kernels are always used.

Sampling uses the exponential race: token = argmax(probs / E) with E ~ Exp(1) i.i.d. per entry.
It draws exactly from probs, needs no normalisation, and row i's result depends only on row i's
probabilities and on the generator that drew row i's noise.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
from collections.abc import Callable, Sequence
from typing import NamedTuple, Union

import torch

from engine.runtime.devices import host_to_device
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# None: default RNG for every row. One Generator: one stream for the whole batch (simulations).
# A sequence: row i uses generators[i] (None entries use the default RNG).
Generators = Union[torch.Generator, Sequence[Union[torch.Generator, None]], None]


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """logits: [N, V], temperature: [N] -> [N, V] float32 logits / temperature.
    Rows with temperature 0 (greedy) are divided by 1; the caller takes their argmax."""
    safe = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    return logits.float() / safe.to(device=logits.device, dtype=torch.float32).unsqueeze(1)


def _renormalise(probs: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """probs, keep: [N, V] -> [N, V], zero where ~keep, each row rescaled to sum 1."""
    kept = probs * keep
    return kept / kept.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(kept.dtype).tiny)


def top_k_renorm_prob(probs: torch.Tensor, top_k: torch.Tensor, max_k: int | None = None) -> torch.Tensor:
    """probs: [N, V], top_k: [N] int -> [N, V]. Keep every entry >= the k-th largest of its row
    (ties with it are kept, so more than k may survive) and renormalise. k <= 0 or k >= V leaves
    the row unchanged. max_k: optional upper bound on the active k values; when given, a
    top-`max_k` selection replaces the full sort (no device sync needed to know it)."""
    vocab = probs.shape[-1]
    k = top_k.to(device=probs.device, dtype=torch.long)
    active = (k > 0) & (k < vocab)
    if max_k is not None and 0 < max_k < vocab:
        ranked = probs.topk(max_k, dim=-1).values
    else:
        ranked = probs.sort(dim=-1, descending=True).values
    kth = ranked.gather(1, (k.clamp(1, ranked.shape[1]) - 1).unsqueeze(1))
    return _renormalise(probs, (probs >= kth) | ~active.unsqueeze(1))


def top_p_renorm_prob(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """probs: [N, V], top_p: [N] float in (0, 1] -> [N, V]. Per row, the boundary is the first
    entry (in descending order) at which the cumulative mass reaches p * row total; every entry
    >= that boundary value is kept (ties at the boundary survive), the rest zeroed, then the row
    is renormalised. p >= 1 leaves the row unchanged. Masses are summed in float64 so the cut
    does not depend on float32 rounding."""
    vocab = probs.shape[-1]
    p = top_p.to(device=probs.device, dtype=torch.float64).unsqueeze(1)
    ranked = probs.sort(dim=-1, descending=True).values
    cumulative = ranked.double().cumsum(dim=-1)
    boundary_index = (cumulative < p * cumulative[:, -1:]).sum(dim=-1, keepdim=True).clamp_max(vocab - 1)
    boundary = ranked.gather(1, boundary_index)
    return _renormalise(probs, (probs >= boundary) | (p >= 1.0))


def min_p_renorm_prob(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """probs: [N, V], min_p: [N] in [0, 1] -> [N, V]. Drop entries < min_p * row max (threshold
    computed in probs' dtype), renormalise. min_p 0 leaves the row unchanged."""
    threshold = min_p.to(device=probs.device, dtype=probs.dtype).unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return _renormalise(probs, probs >= threshold)


def greedy_sample(logits: torch.Tensor) -> torch.Tensor:
    """logits: [N, V] -> [N] int64 argmax; ties resolve to the lowest index (torch.argmax
    returns the first maximal index on every device)."""
    return logits.argmax(dim=-1)


class SamplingKernels(NamedTuple):
    """One implementation of the renormalisation ops; signatures as the torch functions above."""

    name: str
    top_k_renorm: Callable[[torch.Tensor, torch.Tensor, int | None], torch.Tensor]
    top_p_renorm: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


TORCH_KERNELS = SamplingKernels("torch", top_k_renorm_prob, top_p_renorm_prob)


def _disabled_k_to_vocab(probs: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Fast kernels take k in [1, V]; map our 'disabled' values (k <= 0 or k >= V) to V."""
    vocab = probs.shape[-1]
    k = top_k.to(device=probs.device)
    return torch.where((k > 0) & (k < vocab), k, torch.full_like(k, vocab)).to(torch.int32)


def _load_flashinfer() -> SamplingKernels:
    module = importlib.import_module("flashinfer.sampling")
    return SamplingKernels(
        "flashinfer",
        lambda probs, top_k, max_k=None: module.top_k_renorm_probs(probs.float(), _disabled_k_to_vocab(probs, top_k)),
        lambda probs, top_p: module.top_p_renorm_probs(probs.float(), top_p.to(probs.device, torch.float32)),
    )


def _load_aiter() -> SamplingKernels:
    module = importlib.import_module("aiter.ops.sampling")
    return SamplingKernels(
        "aiter",
        lambda probs, top_k, max_k=None: module.top_k_renorm_probs(probs.float(), _disabled_k_to_vocab(probs, top_k), 0),
        top_p_renorm_prob,  # aiter.ops.sampling has no top_p_renorm_probs: torch for that one
    )


_FAST_KERNEL_LOADERS: dict[str, Callable[[], SamplingKernels]] = {"flashinfer": _load_flashinfer, "aiter": _load_aiter}


@functools.lru_cache(maxsize=None)
def _try_load(name: str) -> SamplingKernels | None:
    try:
        return _FAST_KERNEL_LOADERS[name]()
    except (ImportError, AttributeError, OSError) as exc:
        logger.info("sampling kernels %r unavailable (%s); using torch", name, exc)
        return None


def resolve_kernels(device: torch.device | str, preference: str = "auto") -> SamplingKernels:
    """Pick the renormalisation kernels for `device`. preference: "auto" (aiter on ROCm,
    flashinfer on CUDA, when importable; torch otherwise), "torch", "flashinfer" or "aiter"
    (an explicit fast choice that cannot load raises RuntimeError). CPU always gets torch."""
    device = torch.device(device)
    if preference == "torch" or device.type == "cpu":
        return TORCH_KERNELS
    if preference == "auto":
        loaded = _try_load("aiter" if torch.version.hip else "flashinfer")
        return loaded if loaded is not None else TORCH_KERNELS
    if preference not in _FAST_KERNEL_LOADERS:
        raise ValueError(f"unknown sampling kernels {preference!r}")
    loaded = _try_load(preference)
    if loaded is None:
        raise RuntimeError(f"sampling kernels {preference!r} requested but not importable")
    return loaded


def logits_to_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
    *,
    max_top_k: int | None = None,
    has_greedy_rows: bool = True,
    kernels: SamplingKernels = TORCH_KERNELS,
) -> torch.Tensor:
    """logits: [N, V]; temperature, top_p, min_p: [N] float; top_k: [N] int -> [N, V] float32.

    The distribution each row is sampled from: softmax(logits / temperature), then top-k, top-p
    (on the top-k-renormalised probs), then min-p. A filter passed as None is skipped. Rows with
    temperature 0 get a one-hot of their argmax (lowest index on ties); has_greedy_rows=False
    promises there are none and skips that merge. max_top_k: see top_k_renorm_prob."""
    probs = torch.softmax(apply_temperature(logits, temperature), dim=-1)
    if top_k is not None:
        probs = kernels.top_k_renorm(probs, top_k, max_top_k)
    if top_p is not None:
        probs = kernels.top_p_renorm(probs, top_p)
    if min_p is not None:
        probs = min_p_renorm_prob(probs, min_p)
    if not has_greedy_rows:
        return probs
    greedy = (temperature <= 0).to(logits.device).unsqueeze(1)
    one_hot = torch.zeros_like(probs).scatter_(1, greedy_sample(logits).unsqueeze(1), 1.0)
    return torch.where(greedy, one_hot, probs)


def fill_exponential_(noise: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Fill `noise` in place with Exp(1) draws, -log(1 - U) with U ~ U[0, 1) (one uniform per entry)."""
    return noise.uniform_(generator=generator).neg_().log1p_().neg_()


def exponential_noise(shape: tuple[int, int], device: torch.device, generators: Generators) -> torch.Tensor:
    """[rows, cols] float32 i.i.d. Exp(1) noise. With a sequence of generators, row i is drawn
    from generators[i] alone (rows with None share one draw from the default RNG)."""
    noise = torch.empty(shape, device=device, dtype=torch.float32)
    if generators is None or isinstance(generators, torch.Generator):
        return fill_exponential_(noise, generators)
    if len(generators) != shape[0]:
        raise ValueError(f"need one generator entry per row: {len(generators)} != {shape[0]}")
    default_rows = [row for row, gen in enumerate(generators) if gen is None]
    for row, gen in enumerate(generators):
        if gen is not None:
            fill_exponential_(noise[row], gen)
    if default_rows:
        noise[default_rows] = fill_exponential_(torch.empty((len(default_rows), shape[1]), device=device), None)
    return noise


def sample_with_noise(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """probs: [N, V] (need not be normalised), noise: [N, V] Exp(1) -> [N] int64 = argmax(probs / noise)."""
    return (probs.float() / noise.clamp_min(torch.finfo(torch.float32).tiny)).argmax(dim=-1)


def sample(probs: torch.Tensor, generators: Generators = None) -> torch.Tensor:
    """probs: [N, V] -> [N] int64, row i drawn from probs[i] (exponential race). With a sequence
    of generators, a seeded row's token depends only on its probs and its generator's state,
    whatever the rest of the batch and whatever its row index."""
    return sample_with_noise(probs, exponential_noise(tuple(probs.shape), probs.device, generators))


def top_logprobs(logits: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [N, V] -> (values [N, n] float32, ids [N, n] int64): the n largest entries of
    log_softmax(logits) - the RAW model distribution, before temperature and filters - in
    descending order (order among exactly tied values unspecified)."""
    return torch.log_softmax(logits.float(), dim=-1).topk(n, dim=-1)


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """logits: [N, V], token_ids: [N] -> [N] float32 log_softmax(logits)[i, token_ids[i]] (raw model distribution)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return logprobs.gather(1, token_ids.to(logits.device).long().unsqueeze(1)).squeeze(1)


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A request's generator: seeded on `device` when seed is given, else None (default RNG)."""
    return None if seed is None else torch.Generator(device=device).manual_seed(seed)


@dataclasses.dataclass(frozen=True)
class SamplingBatch:
    """The sampling settings of one step's rows, built once per step by `from_params`.

    temperature, top_p, min_p: [N] float32; top_k: [N] int64; greedy: [N] bool (all on `device`).
    Greedy rows carry disabled filters (their distribution is a one-hot of the argmax).
    generators: one entry per row (None = default RNG). The flags let each step skip unused
    filters without a device sync: needs_top_k etc. are False when no row enables the filter."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    greedy: torch.Tensor
    generators: tuple[torch.Generator | None, ...]
    all_greedy: bool
    any_greedy: bool
    needs_top_k: bool
    needs_top_p: bool
    needs_min_p: bool
    max_top_k: int
    max_logprobs: int
    kernels: SamplingKernels = TORCH_KERNELS

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None] | None = None,
        device: torch.device | str = "cpu",
        kernels: str = "auto",
    ) -> SamplingBatch:
        """params: one SamplingParams per row; generators: one per row (None: all default RNG)."""
        if not params:
            raise ValueError("SamplingBatch needs at least one row")
        gens = tuple(generators) if generators is not None else (None,) * len(params)
        if len(gens) != len(params):
            raise ValueError(f"{len(gens)} generators for {len(params)} rows")
        sampled = [p for p in params if not p.greedy]
        enabled_k = [p.top_k for p in sampled if p.top_k > 0]
        # One upload for the five per-row settings (float32 holds top_k exactly below 2**24): one pinned,
        # non-blocking copy on a GPU instead of five blocking ones from pageable memory.
        rows = len(params)
        packed = host_to_device([p.temperature for p in params] + [-1 if p.greedy else p.top_k for p in params]
                                + [1.0 if p.greedy else p.top_p for p in params]
                                + [0.0 if p.greedy else p.min_p for p in params] + [float(p.greedy) for p in params],
                                torch.float32, torch.device(device))
        temperature, top_k, top_p, min_p, greedy = packed.view(5, rows)
        return cls(
            temperature=temperature,
            top_k=top_k.to(torch.int64),
            top_p=top_p,
            min_p=min_p,
            greedy=greedy > 0.5,
            generators=gens,
            all_greedy=not sampled,
            any_greedy=len(sampled) < len(params),
            needs_top_k=bool(enabled_k),
            needs_top_p=any(p.top_p < 1.0 for p in sampled),
            needs_min_p=any(p.min_p > 0.0 for p in sampled),
            max_top_k=max(enabled_k, default=0),
            max_logprobs=max(p.logprobs for p in params),
            kernels=resolve_kernels(device, kernels),
        )

    @property
    def num_rows(self) -> int:
        return len(self.generators)

    def repeat_rows(self, counts: Sequence[int]) -> SamplingBatch:
        """Row i repeated counts[i] times (e.g. k_i + 1 verification rows per sequence); a
        repeated row keeps its generator, which then draws for each of its rows in order."""
        if len(counts) != self.num_rows:
            raise ValueError(f"{len(counts)} counts for {self.num_rows} rows")
        index = host_to_device([row for row, count in enumerate(counts) for _ in range(count)], torch.int64,
                               self.temperature.device)
        return dataclasses.replace(
            self,
            temperature=self.temperature.index_select(0, index),
            top_k=self.top_k.index_select(0, index),
            top_p=self.top_p.index_select(0, index),
            min_p=self.min_p.index_select(0, index),
            greedy=self.greedy.index_select(0, index),
            generators=tuple(gen for gen, count in zip(self.generators, counts) for _ in range(count)),
        )

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: [N, V] -> [N, V] float32, each row's sampling distribution (one-hot when greedy)."""
        return logits_to_probs(
            logits, self.temperature,
            self.top_k if self.needs_top_k else None,
            self.top_p if self.needs_top_p else None,
            self.min_p if self.needs_min_p else None,
            max_top_k=self.max_top_k, has_greedy_rows=self.any_greedy, kernels=self.kernels)

    def sample(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: [N, V] -> [N] int64 next tokens; all-greedy batches take the argmax directly."""
        if self.all_greedy:
            return greedy_sample(logits)
        return sample(self.probs(logits), self.generators)
