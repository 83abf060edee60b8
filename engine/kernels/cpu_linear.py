"""Few-row float32 matmuls on the CPU: through oneDNN, with each weight packed once into oneDNN's blocked
layout (what PyTorch's inductor does for CPU linears), or, for small weights, through torch.mm against a
row-major copy of the weight's transpose.

A speculative verify step multiplies 2-16 rows per sequence by every weight. There MKL's sgemm is
compute-bound and slow for so few rows, while oneDNN with a packed weight is not; measured on one AVX-512
core (1 thread, hot caches), [8, 192] x [192, 4096]: 187 us through F.linear, 74 us packed; [8, 192] x
[192, 2048]: 94 vs 46 us; [8, 192] x [192, 512]: 23 vs 18 us. One row (plain decode) gains nothing (a GEMV is
bound by reading the weight) and a narrow weight loses (oneDNN's fixed cost per call, ~10 us), so only row
counts in ROWS and weights of at least MIN_OUT outputs take this path; everything else is F.linear. The
packed copy is this process's own (weights shared through engine/weights/weight_store.py are not packed in
place), so the packed copies of a process are capped (PDSERVE_CPU_PACKED_LINEAR_MB, default 256 MiB: the
embedded models need ~16 MiB; a weight that would pass the cap stays on F.linear); a copy is rebuilt when
its weight tensor is rebound or modified. Results agree with F.linear to
float32 rounding (max abs difference ~1e-5 on logits), as MKL's own GEMV and GEMM paths agree with each
other.

Small weights (at most TRANSPOSED_MAX_BYTES, 4 MiB: they stay in the core's caches between calls) at 2-64 rows
take a third path first: torch.mm against a row-major copy of the weight's transpose. MKL's small GEMMs run
faster with the weight laid out [in, out] than through F.linear's transposed operand, and faster than oneDNN's
per-call cost; measured on one AVX-512 core (hot caches), [9, 192] x [192, 1152]: 52.6 us F.linear, 42.3 us
packed, 32.7 us transposed; [9, 192] x [192, 576]: 27.5 / 30.0 / 16.1 us. A K3-shaped verify step (9 rows on
every weight of the embedded K3 model) got ~13% faster: speculation 1.14x -> 1.30x, the two layouts taking
turns in one process (benchmarks/bench_linear_layout.py). Large weights are read from memory anyway (no gain
measured on the peer checkpoint's decode steps), and one row stays a GEMV on F.linear (the transposed layout is
slower there). Transposed copies count against the same cap as the packed ones.

Off on GPUs, for other dtypes, when autograd records (training), and where this torch build has no oneDNN
linear ops (the transposed path needs none); PDSERVE_CPU_PACKED_LINEAR=0 turns both off."""
from __future__ import annotations

import os
import weakref

import torch
import torch.nn.functional as F

ROWS = (2, 16)
MIN_OUT = 256
TRANSPOSED_ROWS = (2, 64)
TRANSPOSED_MAX_BYTES = 4 * 2**20
ENABLED = os.environ.get("PDSERVE_CPU_PACKED_LINEAR", "1") != "0"
_OPS = getattr(torch.ops, "mkldnn", None)
AVAILABLE = (_OPS is not None and hasattr(_OPS, "_linear_pointwise") and hasattr(_OPS, "_reorder_linear_weight")
             and torch.backends.mkldnn.is_available() and ENABLED)
_ATTR = "_pdserve_packed"  # on the weight tensor: (its data_ptr, its _version, the packed weight or None, release)
_TRANSPOSED_ATTR = "_pdserve_transposed"  # the same for the row-major transposed copy
BUDGET_BYTES = int(float(os.environ.get("PDSERVE_CPU_PACKED_LINEAR_MB", "256")) * 2**20)
_packed_bytes = 0  # held by this process's packed and transposed copies


def _plain_cpu_call(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32
            and weight.dim() == 2 and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))


def _rows(x: torch.Tensor) -> int:
    return x.numel() // max(1, x.shape[-1])


def _transposed_fits(rows: int, weight: torch.Tensor) -> bool:
    return (ENABLED and TRANSPOSED_ROWS[0] <= rows <= TRANSPOSED_ROWS[1]
            and weight.numel() * weight.element_size() <= TRANSPOSED_MAX_BYTES)


def _packed_fits(rows: int, weight: torch.Tensor) -> bool:
    return AVAILABLE and ROWS[0] <= rows <= ROWS[1] and weight.shape[0] >= MIN_OUT


def takes_transposed_path(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return _transposed_fits(_rows(x), weight) and _plain_cpu_call(x, weight)


def takes_packed_path(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return _packed_fits(_rows(x), weight) and _plain_cpu_call(x, weight)


def _release(nbytes: int) -> None:
    """A held copy's weight was collected: its bytes leave the count (tests and benchmarks build many models)."""
    global _packed_bytes
    _packed_bytes = max(0, _packed_bytes - nbytes)


def _held_copy(weight: torch.Tensor, attr: str, make) -> torch.Tensor | None:
    """make(weight) kept on the weight tensor, made on first use and again after the tensor was rebound or
    changed; None when holding it would pass the process's cap. A copy counts against the cap until it is
    remade or its weight is collected."""
    global _packed_bytes
    entry = getattr(weight, attr, None)
    if entry is None or entry[0] != weight.data_ptr() or entry[1] != weight._version:
        held = 0
        if entry is not None and entry[2] is not None:
            held = entry[2].numel() * entry[2].element_size()
            entry[3].detach()  # the old copy's release, now done here
        copy, release = None, None
        if _packed_bytes - held + weight.numel() * weight.element_size() <= BUDGET_BYTES:
            with torch.no_grad():
                copy = make(weight.detach())
        nbytes = copy.numel() * copy.element_size() if copy is not None else 0
        _packed_bytes = max(0, _packed_bytes - held) + nbytes
        if copy is not None:
            release = weakref.finalize(weight, _release, nbytes)
        entry = (weight.data_ptr(), weight._version, copy, release)
        setattr(weight, attr, entry)
    return entry[2]


def packed_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight in oneDNN's layout (see _held_copy)."""
    return _held_copy(weight, _ATTR, lambda w: _OPS._reorder_linear_weight(w, ROWS[1]))


def transposed_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """weight.t() as a row-major [in, out] tensor (see _held_copy)."""
    return _held_copy(weight, _TRANSPOSED_ATTR, lambda w: w.t().contiguous())


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(x, weight) (no bias), through the transposed copy or oneDNN's packed weight where that pays
    (see above). One row (every plain decode step) leaves after one check."""
    rows = _rows(x)
    if rows < 2 or not _plain_cpu_call(x, weight):
        return F.linear(x, weight)
    flat = x.reshape(rows, x.shape[-1])
    if _transposed_fits(rows, weight) and (transposed := transposed_weight(weight)) is not None:
        return torch.mm(flat, transposed).view(*x.shape[:-1], weight.shape[0])
    if _packed_fits(rows, weight) and (packed := packed_weight(weight)) is not None:
        out = _OPS._linear_pointwise(flat if flat.is_contiguous() else flat.contiguous(), packed, None, "none", [], "")
        return out.view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight)
